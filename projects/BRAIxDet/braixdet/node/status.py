"""The node's counters, written to ``<spool>/status.json`` (no identifiers: counts only)."""
import collections
import os
import threading
import time

from ..utils.io import atomic_write_json

__all__ = ["NodeStatus"]


class NodeStatus:
    """Thread-safe counters by group (``associations``, ``instances``, ``studies``,
    ``results``) plus gauges set by their owners (e.g. studies pending, outbox size)."""

    def __init__(self, path: str):
        self.path = path
        self.started = time.time()
        self._counts = collections.defaultdict(collections.Counter)
        self._gauges = {}
        self._lock = threading.Lock()
        self._dirty = True

    def count(self, group: str, name: str, n: int = 1):
        with self._lock:
            self._counts[group][name] += n
            self._dirty = True

    def gauge(self, group: str, name: str, value):
        with self._lock:
            if self._gauges.get((group, name)) != value:
                self._gauges[(group, name)] = value
                self._dirty = True

    def get(self, group: str, name: str) -> int:
        with self._lock:
            return self._counts[group][name]

    def snapshot(self) -> dict:
        with self._lock:
            out = {g: dict(c) for g, c in self._counts.items()}
            for (g, name), v in self._gauges.items():
                out.setdefault(g, {})[name] = v
        return {"started": round(self.started, 3), "updated": round(time.time(), 3), **out}

    def write(self, force: bool = False):
        """Write status.json when something changed (atomic; not fsync'ed: it is a view)."""
        with self._lock:
            if not (self._dirty or force):
                return
            self._dirty = False
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        atomic_write_json(self.path, self.snapshot(), indent=1, fsync=False)
