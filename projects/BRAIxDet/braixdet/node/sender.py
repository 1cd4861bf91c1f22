"""The sending side of the DICOM node: C-STORE of the outbox to the destination, with retry.

``ResultSender`` runs one thread. When woken (a version was committed) or when its backoff has
passed, it opens one association to the destination proposing the SR and GSPS storage classes in
explicit and implicit VR little endian, sends every outbox file (``Spool.outbox``) in a transfer
syntax the destination accepted (pynetdicom converts between the two uncompressed syntaxes), and
deletes each file once the destination answered success (0x0000) or a warning (0xB000-0xBFFF).
A refused association, an unreachable destination or a failure status leaves the file where it
is and waits ``retry_base * 2**failures`` seconds, at most ``retry_max``, before the next try;
a success resets the wait. Files a kill left in the outbox are sent by the next start.

One log line per sent file and per failed attempt, naming the study only by its spool pseudonym.
"""
import logging
import threading
import time
from typing import Optional

import pydicom
from pydicom.uid import ExplicitVRLittleEndian, ImplicitVRLittleEndian
from pynetdicom import AE
from pynetdicom.sop_class import ComprehensiveSRStorage, GrayscaleSoftcopyPresentationStateStorage

from .spool import Spool
from .status import NodeStatus

__all__ = ["Destination", "ResultSender"]

logger = logging.getLogger(__name__)

RESULT_CLASSES = (ComprehensiveSRStorage, GrayscaleSoftcopyPresentationStateStorage)


class Destination:
    """Where results go: ``HOST:PORT:AET``."""

    def __init__(self, host: str, port: int, ae_title: str):
        self.host, self.port, self.ae_title = host, int(port), ae_title

    @classmethod
    def parse(cls, spec: str) -> "Destination":
        parts = spec.rsplit(":", 2)
        if len(parts) != 3 or not parts[1].isdigit() or not parts[2] or not parts[0]:
            raise ValueError(f"--send-to {spec!r}: expected HOST:PORT:AET")
        return cls(parts[0], int(parts[1]), parts[2])

    def __str__(self):
        return f"{self.ae_title}@{self.host}:{self.port}"


class ResultSender:
    """Background sender of the outbox (module doc)."""

    def __init__(self, spool: Spool, status: NodeStatus, destination: Optional[Destination],
                 ae_title: str, retry_base: float = 5.0, retry_max: float = 300.0,
                 tls_context=None, tls_hostname: Optional[str] = None):
        self.spool, self.status, self.destination = spool, status, destination
        self.retry_base, self.retry_max = float(retry_base), float(retry_max)
        self.tls_args = (tls_context, tls_hostname) if tls_context is not None else None
        self.ae = AE(ae_title=ae_title)
        for sop_class in RESULT_CLASSES:
            self.ae.add_requested_context(sop_class, [ExplicitVRLittleEndian,
                                                      ImplicitVRLittleEndian])
        self.failures = 0
        self._next_try = 0.0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = None

    def start(self):
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="node-sender", daemon=True)
        self._thread.start()
        self.wake()

    def stop(self):
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def wake(self):
        """New results: try now unless backing off."""
        self._wake.set()

    def pending(self) -> int:
        n = len(self.spool.outbox())
        self.status.gauge("results", "outbox", n)
        return n

    def _run(self):
        while not self._stop.is_set():
            now = time.monotonic()
            if now < self._next_try:  # backing off: a new result does not cut the wait short
                self._stop.wait(min(self._next_try - now, 0.5))
                continue
            self._wake.clear()
            if self.destination is not None and self.pending():
                if self.send_outbox():
                    self.failures, self._next_try = 0, 0.0
                else:
                    self._next_try = time.monotonic() + self._delay()
                    self.failures += 1
                self.pending()
                continue  # results committed while sending go at once
            self._wake.wait(1.0)

    def _delay(self) -> float:
        return min(self.retry_base * 2 ** self.failures, self.retry_max)

    def send_outbox(self) -> bool:
        """One association: send every outbox file; False when anything failed."""
        items = self.spool.outbox()
        dest = self.destination
        assoc = self.ae.associate(dest.host, dest.port, ae_title=dest.ae_title,
                                  tls_args=self.tls_args)
        if not assoc.is_established:
            why = "rejected" if assoc.is_rejected else "aborted" if assoc.is_aborted else \
                "unreachable"
            self.status.count("results", "send_failures")
            logger.warning("send to %s failed: association %s; %d results kept in the outbox, "
                           "retry in %.0f s", dest, why, len(items), self._delay())
            return False
        ok = True
        try:
            for item in items:
                if not assoc.is_established:
                    ok = False
                    break
                status = self._send_one(assoc, item)
                ok = ok and status
        finally:
            if assoc.is_established:
                assoc.release()
        return ok

    def _send_one(self, assoc, item) -> bool:
        try:
            ds = pydicom.dcmread(item.path)
            rsp = assoc.send_c_store(ds)
            code = int(rsp.Status) if "Status" in rsp else None
        except (ValueError, RuntimeError, OSError) as e:  # e.g. no accepted context
            code, detail = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        else:
            detail = f"status 0x{code:04X}" if code is not None else "no response"
        if code is not None and (code == 0 or 0xB000 <= code <= 0xBFFF):
            self.spool.acknowledge(item)
            self.status.count("results", "sent")
            logger.info("sent %s of study %s v%d to %s (%s)", item.kind, item.study[:12],
                        item.version, self.destination, detail)
            return True
        self.status.count("results", "send_failures")
        logger.warning("send of %s of study %s v%d to %s failed (%s); kept in the outbox",
                       item.kind, item.study[:12], item.version, self.destination, detail)
        return False
