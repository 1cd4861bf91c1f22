"""The DICOM node: spool, SCP, scheduler and sender wired together (``tools/serve.py``).

``DicomNode(settings, predictor_factory).start()`` cleans what a kill left half-written
(``Spool.clean_partial``), finds the pending studies and unacknowledged results of the spool
(``StudyScheduler.recover``), starts the workers, the sender and finally the SCP, so that the
first association already finds the node's state complete. ``stop()`` stops accepting, lets the
running predictions finish and writes ``status.json`` a last time. ``run()`` serves until a
signal, ``max_runtime`` or ``exit_when_idle`` (nothing open, pending or unsent for that long).
"""
import dataclasses
import logging
import ssl
import threading
import time
from typing import Callable, Optional, Sequence

from .scheduler import StudyScheduler
from .scp import AllowEntry, StoreSCP
from .sender import Destination, ResultSender
from .spool import Spool
from .status import NodeStatus

__all__ = ["DicomNode", "NodeSettings", "client_tls_context", "server_tls_context"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class NodeSettings:
    spool: str
    ae_title: str = "BRAIXDET"
    host: str = "127.0.0.1"  # loopback unless told otherwise (safe default)
    port: int = 11112
    allow: Sequence[AllowEntry] = ()  # empty: loopback connections only
    destination: Optional[Destination] = None  # None: results stay in the outbox
    quiet_period: float = 30.0
    workers: int = 1
    score_thresh: float = 0.05
    sr_pseudonym_map: Optional[str] = None  # PseudonymMap file (inference/deidentify.py)
    retry_base: float = 5.0
    retry_max: float = 300.0
    min_free_mb: int = 512
    max_associations: int = 16
    server_tls: Optional[ssl.SSLContext] = None
    client_tls: Optional[ssl.SSLContext] = None


def server_tls_context(cert: str, key: str, ca: Optional[str] = None) -> ssl.SSLContext:
    """TLS for the SCP; with ``ca`` the peers must present a certificate it signed."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert, key)
    if ca:
        ctx.load_verify_locations(ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_tls_context(ca: Optional[str], cert: Optional[str] = None,
                       key: Optional[str] = None) -> ssl.SSLContext:
    """TLS for sending results: verify the destination with ``ca`` (system CAs when None)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class DicomNode:
    def __init__(self, settings: NodeSettings, predictor_factory: Callable):
        self.settings = s = settings
        self.spool = Spool(s.spool)
        self.status = NodeStatus(f"{self.spool.root}/status.json")
        self.sender = ResultSender(self.spool, self.status, s.destination, s.ae_title,
                                   retry_base=s.retry_base, retry_max=s.retry_max,
                                   tls_context=s.client_tls,
                                   tls_hostname=s.destination.host if s.destination else None)
        self.scheduler = StudyScheduler(
            self.spool, self.status, predictor_factory, quiet_period=s.quiet_period,
            workers=s.workers, score_thresh=s.score_thresh, sr_pseudonym_map=s.sr_pseudonym_map,
            on_committed=self.sender.wake)
        self.scp = StoreSCP(s.ae_title, s.host, s.port, self.spool, self.status,
                            self.scheduler.arrived, allow=s.allow, ssl_context=s.server_tls,
                            min_free_bytes=s.min_free_mb << 20,
                            max_associations=s.max_associations)
        self._stop = threading.Event()
        self._started = False

    @property
    def port(self) -> int:
        return self.scp.port

    def start(self):
        # highdicom logs the UIDs of the images it copies modules from at INFO: not in our logs
        logging.getLogger("highdicom").setLevel(max(logging.WARNING,
                                                    logging.getLogger("highdicom").level))
        cleaned = self.spool.clean_partial()
        pending = self.scheduler.recover()
        unsent = self.sender.pending()
        self.scheduler.start()
        self.sender.start()
        self.scp.start()
        self._started = True
        if self.settings.destination is None:
            logger.warning("no --send-to: results stay in the outbox of %s", self.spool.root)
        logger.info("spool %s: %d pending studies, %d unsent results, %d partial files removed",
                    self.spool.root, pending, unsent, cleaned)
        self.status.write(force=True)
        return self

    def idle(self) -> bool:
        """No open association, no study pending or in work, nothing to send."""
        return (self.scp.open_associations == 0 and not self.scheduler.busy and
                (self.settings.destination is None or self.sender.pending() == 0))

    def request_stop(self, *_):
        self._stop.set()

    def run(self, max_runtime: Optional[float] = None, exit_when_idle: Optional[float] = None):
        """Serve until ``request_stop``, ``max_runtime`` seconds, or ``exit_when_idle``
        seconds in a row of ``idle()``."""
        t0 = time.monotonic()
        idle_since = None
        while not self._stop.wait(0.2):
            self.status.write()
            now = time.monotonic()
            if max_runtime is not None and now - t0 >= max_runtime:
                break
            if exit_when_idle is not None:
                idle_since = (idle_since or now) if self.idle() else None
                if idle_since is not None and now - idle_since >= exit_when_idle:
                    break

    def stop(self):
        if not self._started:
            return
        self.scp.stop()
        self.scheduler.stop()
        self.sender.stop()
        self.sender.pending()
        self.status.write(force=True)
        self._started = False
        logger.info("DICOM node %s stopped", self.settings.ae_title)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
