"""One run per OUTPUT_DIR: an exclusive lock on ``<OUTPUT_DIR>/.lock``.

Two runs writing the same folder interleave their logs and overwrite each other's checkpoints.
``acquire_output_lock(dir)`` takes an exclusive ``fcntl.flock`` on ``<dir>/.lock`` (which holds
the pid, host and start time of its owner, for the message) or raises ``OutputDirInUseError``,
whose ``str`` is one line a user can act on::

    OUTPUT_DIR /x is in use by another run (pid 123 on host h, started 2024-05-01 10:00:00);
    use another OUTPUT_DIR or stop that run

The kernel drops a flock when its process dies, however it dies (SIGKILL included), so a lock
left by a dead run never blocks: the next run takes it over and says so (the file still names
the dead owner). A clean exit removes the file. Where the file system has no flock (some network
file systems), the pid/host in the file decide: a live process on this host, or any process on
another host, keeps the folder; a dead process on this host is taken over.

Only the main process of a job (rank 0 of machine 0) takes the lock; tools call
``acquire_output_lock`` before writing anything into the folder.
"""
import atexit
import errno
import fcntl
import json
import logging
import os
import socket
import time

__all__ = ["OutputDirInUseError", "OutputDirLock", "acquire_output_lock", "LOCK_NAME"]

logger = logging.getLogger(__name__)

LOCK_NAME = ".lock"
_HELD = {}  # realpath of the folder -> OutputDirLock held by this process
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class OutputDirInUseError(RuntimeError):
    """Another live run holds the OUTPUT_DIR. ``str`` is the one-line message."""

    def __init__(self, output_dir, holder):
        self.output_dir, self.holder = str(output_dir), holder or {}
        super().__init__(f"OUTPUT_DIR {self.output_dir} is in use by another run "
                         f"({_describe(self.holder)}); use another OUTPUT_DIR or stop that run")


def _describe(holder):
    if not holder:
        return "owner unknown"
    return (f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, "
            f"started {holder.get('started', '?')}")


def _read_holder(fd):
    try:
        raw = os.pread(fd, 4096, 0)
        holder = json.loads(raw.decode("utf-8")) if raw.strip() else None
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "started": "?"}  # garbage: someone's, unknown
    return holder if isinstance(holder, dict) else {"pid": "?", "host": "?", "started": "?"}


def _pid_alive(pid):
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, TypeError, OverflowError):
        return True  # exists (another user's) / unknown: assume alive
    return True


class OutputDirLock:
    """The held lock of one folder; ``release()`` (also at exit) removes the lock file."""

    def __init__(self, output_dir, tool="train_net"):
        self.output_dir = os.path.abspath(os.fspath(output_dir))
        self.path = os.path.join(self.output_dir, LOCK_NAME)
        self.tool = tool
        self.fd = None
        self.took_over = None  # holder record of a stale lock taken over, if any
        self.info = None

    def acquire(self):
        os.makedirs(self.output_dir, exist_ok=True)
        for _ in range(20):  # retries only when a releasing owner unlinked the file under us
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in _NO_FLOCK:
                    return self._acquire_without_flock(fd)
                holder = _read_holder(fd)
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise OutputDirInUseError(self.output_dir, holder) from None
                raise
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._own(fd, _read_holder(fd))
                return self
            os.close(fd)  # the previous owner removed the file after we opened it: retry
        raise OutputDirInUseError(self.output_dir, None)

    def _acquire_without_flock(self, fd):
        holder = _read_holder(fd)
        if holder and not (holder.get("host") == socket.gethostname()
                           and not _pid_alive(holder.get("pid"))):
            os.close(fd)
            raise OutputDirInUseError(self.output_dir, holder)
        self._own(fd, holder)
        return self

    def _own(self, fd, previous):
        self.fd = fd
        if previous:
            self.took_over = previous
            dead = previous.get("host") == socket.gethostname() and \
                not _pid_alive(previous.get("pid"))
            logger.warning("OUTPUT_DIR %s: taking over the stale lock of %s%s", self.output_dir,
                           _describe(previous), " (no longer running)" if dead else
                           " (it no longer holds the lock)")
        self.info = {"pid": os.getpid(), "host": socket.gethostname(),
                     "started": time.strftime("%Y-%m-%d %H:%M:%S"), "tool": self.tool}
        data = json.dumps(self.info).encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        try:
            os.fsync(fd)
        except OSError:
            pass
        _HELD[os.path.realpath(self.output_dir)] = self
        atexit.register(self.release)

    def release(self):
        if self.fd is None or os.getpid() != self.info["pid"]:
            return  # not held, or a forked child (e.g. a data loader worker): not its lock
        try:  # remove the file while still holding the lock (see acquire's inode check)
            if os.stat(self.path).st_ino == os.fstat(self.fd).st_ino:
                os.unlink(self.path)
        except OSError:
            pass
        try:
            os.close(self.fd)  # drops the flock
        except OSError:
            pass
        self.fd = None
        _HELD.pop(os.path.realpath(self.output_dir), None)

    def __enter__(self):
        return self if self.fd is not None else self.acquire()

    def __exit__(self, *exc):
        self.release()


def acquire_output_lock(output_dir, tool="train_net"):
    """Lock ``output_dir`` for this process (re-entrant within the process) or raise
    OutputDirInUseError. Released by ``.release()`` or at exit."""
    held = _HELD.get(os.path.realpath(os.path.abspath(os.fspath(output_dir))))
    if held is not None and held.fd is not None:
        return held
    return OutputDirLock(output_dir, tool).acquire()
