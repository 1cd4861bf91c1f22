"""One pipeline stage as a child process: its own process group, signals forwarded, and a
done-marker written last.

A stage is done only when its marker exists: the pipeline writes it (atomically) after the
child exited 0 and its final results are on disk, so a stage killed at any point, even after
its best-so-far export, runs again on a re-run (training resumes from ``last_checkpoint``).
SIGTERM/SIGINT to the pipeline go to the whole process group of the running stage (its data
loader workers and launched ranks included); the pipeline waits for it, then exits with
128 + the signal number, leaving no process behind and the stage's OUTPUT_DIR lock free.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

from ..cli import ToolError, last_error_line
from ..utils.io import atomic_write_json, open_no_follow

DONE = "stage_done.json"
# lines worth showing while a stage runs: training progress, results, reports, problems
PROGRESS = re.compile(r"eta: |copypaste: \S|Split \(|bad inputs:|wrote |Error|error:|"
                      r"Initialised |Algorithm 2: |pseudo-box quality|Schedule:|"
                      r"Exported model|Overall training speed|Resum")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOG_PREFIX = re.compile(r"^\[\d+/\d+ [\d:]+ [\w.]+\]:\s*")  # detectron2's "[date name]: "
STOP_GRACE_S = 60  # how long a stopped stage may take to exit before it is killed


class StageFailed(ToolError):
    """A stage exited non-zero; ``str`` is its own ``error:`` line when it printed one (a bad
    config value, a refused input), so the tool shows that line, not a traceback."""


class StageInterrupted(SystemExit):
    """The pipeline got SIGTERM/SIGINT: the stage was stopped; exit with 128 + signal."""

    def __init__(self, signum):
        super().__init__(128 + signum)
        self.signum = signum


def done_marker(folder):
    return os.path.join(folder, DONE)


def is_done(folder):
    return os.path.exists(done_marker(folder))


def mark_done(folder, **info):
    """Written last, atomically: the stage's results are complete."""
    atomic_write_json(done_marker(folder), {"finished": time.time(), **info}, indent=1)


def _stop_group(proc, signum):
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_with_usage(proc):
    """Reap ``proc`` -> its CPU seconds (user + system, with its own reaped children): the
    child's rusage from wait4, not this process's RUSAGE_CHILDREN, which also counts every other
    child that ended meanwhile (stages run side by side from threads: launcher.run_parallel)."""
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def run_stage(name, cmd, log_path, cwd=None, env=None):
    """Run ``cmd`` in a new process group; full output to ``log_path``, progress lines to
    stdout. Returns the stage's CPU seconds. Raises StageFailed (exit status != 0) or
    StageInterrupted (a signal we forwarded).
    """
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    entry = cmd[2] if cmd[1] == "-m" else os.path.basename(cmd[1])  # module or script
    print(f"\n=== [{name}] {entry} (full log: {log_path})", flush=True)
    received = []
    tail = []
    # line-buffered: a person tailing the full log of a long stage sees each line as it comes
    with open_no_follow(log_path, "w", replace_link=True, buffering=1) as log, subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, start_new_session=True) as proc:

        def forward(signum, _frame):
            received.append(signum)
            # SIGTERM for SIGINT too: the stage exits without its end-of-training hooks
            _stop_group(proc, signal.SIGTERM)

        handlers = {}
        try:
            for s in (signal.SIGTERM, signal.SIGINT):
                handlers[s] = signal.signal(s, forward)
        except ValueError:  # not the main thread: signals stay with the caller
            pass
        try:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-60:]
                if PROGRESS.search(line):
                    shown = LOG_PREFIX.sub("", ANSI.sub("", line.rstrip()))
                    print("   " + shown[:170], flush=True)
            cpu = _wait_with_usage(proc)
        finally:
            if proc.poll() is None:  # we are leaving early (an exception): stop the stage
                _stop_group(proc, signal.SIGTERM)
                try:
                    proc.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    _stop_group(proc, signal.SIGKILL)
                    proc.wait()
            _stop_group(proc, signal.SIGKILL)  # anything of its group still alive
            for s, h in handlers.items():
                signal.signal(s, h)
    if received:
        print(f"=== [{name}] stopped by signal {received[0]}; a re-run resumes it",
              flush=True)
        raise StageInterrupted(received[0])
    if proc.returncode != 0:
        sys.stdout.write("".join(tail))
        cause = last_error_line(tail)
        raise StageFailed(f"{cause} (stage {name}; log: {log_path})" if cause else
                          f"error: stage {name} failed (exit {proc.returncode}); see {log_path}")
    return cpu


def read_json(path):
    with open(path) as f:
        return json.load(f)
