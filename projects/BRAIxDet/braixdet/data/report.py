"""Bad-input report: one line per problem (file + reason), counted by reason, saved as JSON.

Every loader appends here instead of raising, unless ``on_bad_input == "error"``.
"""
import collections
import logging
import threading

from ..utils.io import atomic_write_json

logger = logging.getLogger(__name__)


class BadInputError(Exception):
    """A problem with one input file or row. ``str(err)`` is the one-line message."""

    def __init__(self, path, reason, detail=""):
        self.path, self.reason, self.detail = str(path), reason, detail
        super().__init__(f"{self.path}: {reason}" + (f" ({detail})" if detail else ""))


class BadInputReport:
    """Collects bad inputs and other countable events (e.g. ``aux_missing``) of a dataset."""

    def __init__(self, name="", on_bad_input="skip"):
        if on_bad_input not in ("skip", "error"):
            raise ValueError(f"on_bad_input must be 'skip' or 'error', got {on_bad_input!r}")
        self.name, self.on_bad_input = name, on_bad_input
        self.errors = []  # [{"path", "reason", "detail"}]
        self.counts = collections.Counter()  # reason -> n (bad inputs and events)
        self._lock = threading.Lock()

    def add(self, err: BadInputError):
        """Record a bad input; re-raise it when configured with ``on_bad_input='error'``."""
        if self.on_bad_input == "error":
            raise err
        with self._lock:
            self.errors.append({"path": err.path, "reason": err.reason, "detail": err.detail})
            self.counts[err.reason] += 1
        logger.warning("bad input skipped: %s", err)

    def note(self, err: BadInputError):
        """Record an input that a stated rule decided and KEPT (a repeat view, a duplicate file,
        an exam split, ...): one line like a bad input, marked ``"kept": true``; never raised,
        since the input is still used."""
        with self._lock:
            self.errors.append({"path": err.path, "reason": err.reason, "detail": err.detail,
                                "kept": True})
            self.counts[err.reason] += 1
        logger.warning("input kept by rule: %s", err)

    def count(self, event, n=1):
        """Count a non-error event (e.g. ``aux_missing``, ``laterality_disagreement``)."""
        with self._lock:
            self.counts[event] += n

    @property
    def num_bad(self):
        """Inputs skipped (``note`` lines are kept inputs, not counted here)."""
        return sum(1 for e in self.errors if not e.get("kept"))

    def summary(self):
        parts = ", ".join(f"{k}={v}" for k, v in sorted(self.counts.items())) or "none"
        return f"[{self.name}] bad inputs: {self.num_bad}; counts: {parts}"

    def to_dict(self):
        return {"name": self.name, "num_bad": self.num_bad, "counts": dict(self.counts),
                "errors": list(self.errors)}

    def save(self, path):
        atomic_write_json(path, self.to_dict(), indent=1)
