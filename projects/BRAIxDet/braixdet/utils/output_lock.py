"""One run per OUTPUT_DIR: filelock's FileLock on ``<OUTPUT_DIR>/.lock`` (flock: the kernel frees
a dead run's lock, SIGKILL too; O_NOFOLLOW). The file names its holder for the one-line error."""
import json
import os
import socket
import time

from filelock import FileLock, Timeout

from ..utils.io import refuse_link


class OutputDirInUseError(RuntimeError):
    def __init__(self, out, raw_holder):
        try:
            h = dict(json.loads(raw_holder))
        except (ValueError, TypeError):  # empty or garbage
            h = {}
        super().__init__(f"OUTPUT_DIR {out} is in use by another run (pid {h.get('pid', '?')} on "
                         f"host {h.get('host', '?')}, started {h.get('started', '?')}); use "
                         "another OUTPUT_DIR or stop that run")


def acquire_output_lock(output_dir, tool="train_net"):
    """The held lock of ``output_dir`` (``.release()``; filelock creates the folder)."""
    path = os.path.join(os.path.abspath(os.fspath(output_dir)), ".lock")
    refuse_link(path)  # a planted link: OutputPathRefused (clearer than filelock's ELOOP)

    def name_holder(fd):  # filelock's on_acquired: the lock is held
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "tool": tool,
                                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode(), 0)

    lock = FileLock(path, timeout=0, on_acquired=name_holder)
    try:
        lock.acquire()
    except Timeout:
        with open(path, "rb") as f:
            raise OutputDirInUseError(os.path.dirname(path), f.read(4096)) from None
    return lock
