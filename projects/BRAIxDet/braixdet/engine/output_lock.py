"""One run per OUTPUT_DIR: ``filelock.FileLock`` on ``<OUTPUT_DIR>/.lock`` (flock, O_NOFOLLOW).

The file names its holder (pid, host, start) for the one-line ``OutputDirInUseError``. The kernel
drops the lock of a dead run (SIGKILL too): the next run takes it over and logs it. A symlinked
``.lock`` is refused by filelock's O_NOFOLLOW open (``OutputPathRefused``), never written through.
"""
import errno
import json
import logging
import os
import socket
import time

from filelock import FileLock, Timeout

from ..utils.io import OutputPathRefused

__all__ = ["OutputDirInUseError", "acquire_output_lock", "LOCK_NAME"]
logger, LOCK_NAME, _HELD = logging.getLogger(__name__), ".lock", {}


class OutputDirInUseError(RuntimeError):
    def __init__(self, output_dir, h):
        super().__init__(f"OUTPUT_DIR {output_dir} is in use by another run (pid "
                         f"{h.get('pid', '?')} on host {h.get('host', '?')}, started "
                         f"{h.get('started', '?')}); use another OUTPUT_DIR or stop that run")


def _holder(raw):
    try:
        h = json.loads(raw.decode("utf-8"))
    except ValueError:
        h = {}
    return h if isinstance(h, dict) else {}


class OutputDirLock(FileLock):
    took_over = None  # holder record of the dead run whose lock this one took over

    def _record(self, fd):  # on_acquired: with the lock held
        self.took_over = _holder(os.pread(fd, 4096, 0)) or None
        if self.took_over:
            logger.warning("OUTPUT_DIR %s: taking over the stale lock of pid %s (no longer "
                           "running)", os.path.dirname(self.lock_file), self.took_over.get("pid"))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)

    def release(self, force=True):
        if self.is_locked:  # a clean exit leaves an empty file: nothing to take over next time
            fd = os.open(self.lock_file, os.O_WRONLY | os.O_NOFOLLOW)
            os.ftruncate(fd, 0), os.close(fd)
        super().release(force=True)
        _HELD.pop(self.lock_file, None)


def acquire_output_lock(output_dir, tool="train_net"):
    """Lock ``output_dir`` for this process (re-entrant) or raise OutputDirInUseError."""
    path = os.path.join(os.path.abspath(os.fspath(output_dir)), LOCK_NAME)
    if path in _HELD and _HELD[path].is_locked:
        return _HELD[path]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    lock = OutputDirLock(path, timeout=0, on_acquired=lambda fd: lock._record(fd))
    try:
        lock.acquire()
    except Timeout:
        with open(path, "rb") as f:
            raise OutputDirInUseError(os.path.dirname(path), _holder(f.read(4096))) from None
    except OSError as e:
        if e.errno != errno.ELOOP and not os.path.islink(path):
            raise
        raise OutputPathRefused(path, "it is a symbolic link") from None
    _HELD[path] = lock
    return lock
