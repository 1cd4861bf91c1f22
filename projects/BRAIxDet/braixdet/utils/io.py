"""Crash-safe file output: every file this project writes goes through ``atomic_write``.

A temporary file next to the target is written, flushed, fsync'ed and ``os.replace``'d, so a
reader (or a job killed mid-write) sees either the old file or the complete new one. A write that
fails (full disk, I/O error) removes its temporary file and raises ``OutputWriteError`` whose
``str`` is one line a user can act on (``no space left on device while writing X (free: 12 MB);
...``): torch.save hides the errno behind "inline_container ... unexpected pos", so the first
OSError of the underlying file is recorded and reported instead.

Nothing we write follows a symbolic link out of its folder: ``atomic_write`` creates its temp
file with O_EXCL and ``os.replace`` replaces a link planted at the target by the real file (the
link's target is untouched; logged), so a long run still completes; files that are appended to
are opened with ``open_no_follow`` (O_NOFOLLOW: ``OutputPathRefused``, one line);
``refuse_links(folder)`` checks a folder whose files others (detectron2's log and metrics
writers) will open without O_NOFOLLOW.
"""
import errno
import json
import logging
import math
import os
import shutil
import tempfile

logger = logging.getLogger(__name__)

__all__ = ["OutputPathRefused", "OutputWriteError", "atomic_write", "atomic_write_bytes",
           "atomic_write_json", "fsync_dir", "nan_to_none", "open_no_follow", "refuse_link",
           "refuse_links"]


class OutputPathRefused(ValueError):
    """A file we would write is a symbolic link or resolves outside its folder. One-line ``str``."""

    def __init__(self, path, reason):
        self.path, self.reason = str(path), reason
        super().__init__(f"refusing to write {self.path}: {reason}")


def refuse_link(path):
    """OutputPathRefused when ``path`` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise OutputPathRefused(path, "it is a symbolic link (a planted link would redirect the "
                                      "write outside the output folder); remove it")


def refuse_links(folder):
    """OutputPathRefused for the first symbolic link below ``folder`` (files and sub-folders we
    write, e.g. log.txt, metrics.json, config.yaml, inference/<dataset>/...)."""
    for dirpath, dirnames, filenames in os.walk(folder):  # never descends into a linked folder
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            refuse_link(os.path.join(dirpath, name))


def open_no_follow(path, mode="a", replace_link=False, buffering=-1):
    """``open(path, mode, buffering)`` for writing ("w"/"a", text or binary) that refuses a final
    symlink, or with ``replace_link`` removes it first (a file of ours, e.g. a log; its target is
    left untouched, as ``atomic_write`` does)."""
    if replace_link and os.path.islink(path):
        logger.warning("%s was a symbolic link: replaced by the file, its target left untouched",
                       path)
        os.unlink(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            refuse_link(path)
        raise
    return os.fdopen(fd, mode, buffering)


class OutputWriteError(OSError):
    """Writing ``path`` failed; the file it would have replaced is untouched. One-line ``str``."""

    what = "file"

    def __init__(self, path, cause):
        dirname = os.path.dirname(os.path.abspath(path))
        code = getattr(cause, "errno", None)
        try:
            free = f"{shutil.disk_usage(dirname).free / 2**20:.0f} MB"
        except OSError:
            free = "unknown"
        if code in (errno.ENOSPC, errno.EDQUOT):
            what = "no space left on device" if code == errno.ENOSPC else "disk quota exceeded"
        else:
            what = f"write failed ({getattr(cause, 'strerror', None) or cause})".splitlines()[0]
        super().__init__(code or errno.EIO, f"{what} while writing {self.what} {path} "
                                            f"(free: {free}); {self.unchanged(dirname)}")
        self.path = str(path)

    @staticmethod
    def unchanged(dirname):
        return "no earlier file was changed"

    def __str__(self):
        return self.strerror


def fsync_dir(dirname):
    """Make renames inside ``dirname`` durable (best effort where directories have no fd)."""
    try:
        fd = os.open(dirname, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_tmp(dirname, basename):
    # temp files of earlier writes of the same file that were killed before os.replace
    prefix = f".{basename}."
    for f in os.listdir(dirname):
        if f.startswith(prefix) and f.endswith(".tmp"):
            try:
                os.unlink(os.path.join(dirname, f))
            except OSError:
                pass


class _RecordingWriter:
    """File proxy that remembers the first OSError of a write (see the module docstring)."""

    def __init__(self, f):
        self._f, self.error = f, None

    def write(self, data):
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self):
        try:
            self._f.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name):  # seek, tell, truncate, fileno, ...: the file's own
        return getattr(self._f, name)


def _is_write_failure(exc):
    if isinstance(exc, OSError):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and any(
        s in msg for s in ("inline_container", "file write failed", "PytorchStreamWriter",
                           "No space left"))


def atomic_write(path, write_fn, mode="wb", remove_stale=False, error_cls=OutputWriteError,
                 fsync=True):
    """``write_fn(f)`` into a temp file next to ``path``, then atomically replace ``path``.

    ``remove_stale``: delete temp files of earlier killed writes of the same path (only safe
    with a single writer per path). ``fsync``: make content and rename durable (checkpoints,
    results); a cache that can be rebuilt may skip it.
    """
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    if os.path.islink(path):
        logger.warning("%s was a symbolic link: replaced by the file, its target left untouched",
                       path)
    if remove_stale:
        _remove_stale_tmp(dirname, os.path.basename(path))
    fd, tmp = tempfile.mkstemp(dir=dirname, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    writer = None
    try:
        with os.fdopen(fd, mode) as f:
            writer = _RecordingWriter(f)
            write_fn(writer)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, Exception) and not isinstance(e, OutputWriteError) and \
                _is_write_failure(e):
            cause = (writer.error if writer is not None else None) or e
            raise error_cls(path, cause) from e
        raise
    if fsync:
        fsync_dir(dirname)  # make the rename itself durable


def atomic_write_bytes(path, data: bytes, **kwargs):
    atomic_write(path, lambda f: f.write(data), "wb", **kwargs)


def atomic_write_text(path, text: str, **kwargs):
    atomic_write(path, lambda f: f.write(text), "w", **kwargs)


def atomic_write_json(path, obj, indent=None, **kwargs):
    atomic_write_text(path, json.dumps(obj, indent=indent), **kwargs)


def nan_to_none(obj):
    """``obj`` with every non-finite float (e.g. AP without any lesion, an interval from one
    seed) as None, so that json writes strict JSON (null), which every reader parses."""
    if isinstance(obj, dict):
        return {k: nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [nan_to_none(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
