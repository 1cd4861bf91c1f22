"""The tools' common entry: every script in tools/ runs ``sys.exit(run_tool(main))``, so a failure
ends with ONE actionable last line ``error: <cause>`` and exit status 1.

Our own errors (a refused checkpoint or output path, a busy output folder, a bad config value,
a bad input, a failed pre-flight check, a missing file, ...) already name a cause a user can act
on: only their first line is printed. Anything else is a bug rather than a cause: its traceback
goes before the line. ``last_error_line`` is how a parent (the pipeline) finds a child tool's line
to show instead of its own traceback (``raise ToolError(line)``).

tools/install_detectron2.py is the one script outside: it installs detectron2, which this
package imports, so it cannot import this module.
"""
import sys
import traceback

from .config import ConfigValueError
from .data.report import BadInputError
from .engine.preflight import PreflightError
from .utils.checkpoint import CheckpointContentError, CheckpointLoadError, CheckpointRefusedError
from .utils.io import OutputPathRefused, OutputWriteError
from .utils.output_lock import OutputDirInUseError

try:  # torch.multiprocessing: a worker's exception arrives as text (its traceback)
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException
except ImportError:  # pragma: no cover - older torch
    ProcessExitedException = ProcessRaisedException = ()

__all__ = ["ToolError", "last_error_line", "run_tool", "user_error_line"]


class ToolError(RuntimeError):
    """A failure whose ``str`` already is the one line to show, e.g. a pipeline stage's own
    ``error:`` line (``run_tool`` prints it without a traceback)."""


# Our one-line errors: the message already names a cause a user can act on.
KNOWN_ERRORS = (PreflightError, ToolError, OutputDirInUseError, CheckpointRefusedError,
                CheckpointLoadError, OutputWriteError, CheckpointContentError, BadInputError,
                FloatingPointError, OutputPathRefused, ConfigValueError)


def _first_line(text):
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def user_error_line(exc):
    """(``error: ...`` line, known) for an exception that ends a tool.

    ``known``: the message is already a cause a user can act on (our one-line errors, bad
    inputs, a diverging loss, a missing file, a bad config key); otherwise the line names the
    exception type and the caller should keep the traceback somewhere the user can find it.
    """
    if isinstance(exc, (ProcessRaisedException, ProcessExitedException)):
        text = str(exc).strip()
        last = text.splitlines()[-1].strip() if text else type(exc).__name__
        cls, _, msg = last.partition(": ")
        if msg and cls.rsplit(".", 1)[-1] in {k.__name__ for k in KNOWN_ERRORS}:
            return f"error: {msg}", True
        return f"error: a training process failed: {last}", False
    if isinstance(exc, KNOWN_ERRORS):
        line = _first_line(exc)
        return (line if line.startswith("error: ") else f"error: {line}"), True
    if isinstance(exc, OSError) and exc.filename:
        return f"error: {exc.strerror or type(exc).__name__}: {exc.filename}", True
    if isinstance(exc, FileNotFoundError):
        return f"error: {_first_line(exc)}", True
    if isinstance(exc, KeyError) and "config key" in str(exc):
        return f"error: config: {exc.args[0]}", True
    if isinstance(exc, AssertionError) and str(exc).startswith("Non-existent key"):  # yacs
        return f"error: config: {_first_line(exc)}: not a config key (--opts KEY VALUE ...)", True
    if isinstance(exc, ValueError) and "for config key" in str(exc):  # yacs' type check
        return f"error: config: {_first_line(exc)} (write a float key's value as 5.0, not 5)", \
            True
    return f"error: unexpected {type(exc).__name__}: {_first_line(exc)}", False


def run_tool(main, argv=None, log=None):
    """Exit status of ``main(argv)``: its own when it returns an int (e.g. 2), else 0; or 1 after
    printing its ``error: ...`` line last on stderr (the traceback too, before it, only when the
    cause is not one of ours). ``log``: also called with the line (e.g. a run's log file)."""
    try:
        status = main(argv)
    except Exception as e:  # noqa: BLE001 - every failure ends with one actionable line
        line, known = user_error_line(e)
        if log is not None:
            log(line + "\n")
        sys.stdout.flush()
        if not known:
            sys.stderr.write(traceback.format_exc())
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        return 1
    return status if isinstance(status, int) and not isinstance(status, bool) else 0


def last_error_line(lines):
    """The ``error: ...`` line a failed tool printed last (e.g. a pipeline stage's train_net),
    or None: what a caller shows instead of its own traceback (``raise ToolError(line)``)."""
    for line in reversed(list(lines)):
        if line.strip():
            return line.strip() if line.strip().startswith("error: ") else None
    return None
