"""The receiving side of the DICOM node: C-ECHO and C-STORE SCP on pynetdicom.

* Presentation contexts: Verification and the mammography storage classes (Digital Mammography
  X-Ray for presentation and for processing, and Secondary Capture, the class of digitised films
  such as CBIS-DDSM's) in the transfer syntaxes archives send (``TRANSFER_SYNTAXES``). Anything
  else is not accepted at negotiation.
* Allow-list (``AllowEntry``): a calling AE title, optionally bound to one address. Without one,
  only loopback connections are let in (safe default). Checked when the association is
  requested; anything else is rejected (A-ASSOCIATE-RJ, "calling AE title not recognised").
* Each instance is checked from its header before anything is decoded (``inspect_instance``:
  Modality MG, the SOP Instance UID of the request, Rows x Columns x frames within
  ``data.dicom.MAX_PIXELS``, pixel data length consistent with the header, compression ratio
  within ``data.dicom.MAX_COMPRESSION_RATIO``) and written to the spool as the sender encoded
  it (``Spool.store``: atomic, fsync'ed) BEFORE success is answered. Statuses: 0x0000 stored or
  already stored (a re-send of the same SOP Instance UID), 0xC000 cannot understand (not a
  mammogram, malformed, decompression bomb), 0xA700 out of resources (disk full, or less free
  space than ``min_free_bytes``: the sender keeps its copy and retries).

One log line per association (when it closes) and per refused instance; no identifier, only
the calling AE title, its address and counts.
"""
import dataclasses
import io
import ipaddress
import logging
import threading
import time
from typing import Callable, Optional, Sequence

import pydicom
from pydicom.uid import (
    JPEG2000,
    DeflatedExplicitVRLittleEndian,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGBaseline8Bit,
    JPEGExtended12Bit,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)
from pynetdicom import AE, evt
from pynetdicom.sop_class import (
    DigitalMammographyXRayImageStorageForPresentation,
    DigitalMammographyXRayImageStorageForProcessing,
    SecondaryCaptureImageStorage,
    Verification,
)

from ..data.dicom import MAX_COMPRESSION_RATIO, MAX_PIXELS, MAX_SIDE, pseudonymise
from ..data.views import normalize_laterality, normalize_view, patient_stem, resolve_view
from .spool import Spool
from .status import NodeStatus

__all__ = ["AllowEntry", "MAMMOGRAPHY_STORAGE", "ReceivedInstance", "Refused",
           "STATUS_CANNOT_UNDERSTAND", "STATUS_OUT_OF_RESOURCES", "StoreSCP",
           "TRANSFER_SYNTAXES", "inspect_instance"]

logger = logging.getLogger(__name__)

MAMMOGRAPHY_STORAGE = (DigitalMammographyXRayImageStorageForPresentation,
                       DigitalMammographyXRayImageStorageForProcessing,
                       SecondaryCaptureImageStorage)
TRANSFER_SYNTAXES = (ExplicitVRLittleEndian, ImplicitVRLittleEndian,
                     DeflatedExplicitVRLittleEndian, RLELossless, JPEG2000Lossless, JPEG2000,
                     JPEGLSLossless, JPEGLSNearLossless, JPEGLossless, JPEGLosslessSV1,
                     JPEGBaseline8Bit, JPEGExtended12Bit)
STATUS_SUCCESS = 0x0000
STATUS_OUT_OF_RESOURCES = 0xA700  # Refused: out of resources
STATUS_CANNOT_UNDERSTAND = 0xC000  # Error: cannot understand
_RATIO_CHECK_BYTES = 1 << 20  # small images compress far beyond any ratio: check big ones only


class Refused(Exception):
    """An instance the node will not store; ``reason`` is a short token, ``detail`` one line
    without identifiers."""

    def __init__(self, reason, detail=""):
        self.reason, self.detail = reason, detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


@dataclasses.dataclass(frozen=True)
class ReceivedInstance:
    """What the scheduler needs of a stored instance (pseudonyms only)."""

    study: str  # spool key of the node's study (``study_key``)
    instance: str  # spool key of the SOP Instance UID
    view: Optional[tuple]  # ("L"/"R", "CC"/"MLO") or None


def study_key(ds, key: Callable[[str], str]) -> str:
    """The node's unit of completion, a superset of ``predictor.group_exams``' exams: the
    patient (pseudonymised stem) and StudyDate, else the StudyInstanceUID (our choice: archives
    such as CBIS-DDSM give every view its own StudyInstanceUID; the worker then groups the
    study's files exactly as tools/predict.py does). ``key``: ``Spool.key``."""
    stem = patient_stem(str(ds.get("PatientID", "") or "").strip())
    date = str(ds.get("StudyDate", "") or "").strip()
    if stem and date:
        return key("patient-day|" + pseudonymise(stem) + "|" + date)
    uid = str(ds.get("StudyInstanceUID", "") or "").strip()
    if uid:
        return key("study|" + uid)
    return key("instance|" + str(ds.get("SOPInstanceUID", "")))


def instance_view(ds) -> Optional[tuple]:
    """(laterality, view) as the predictor reads them (``views.resolve_view``), or None."""
    res = resolve_view(ds)
    lat, view = normalize_laterality(res.laterality or ""), normalize_view(res.view or "")
    return (lat, view) if lat and view else None


def _int(ds, keyword, default):
    try:
        value = ds.get(keyword, default)
        return int(value if value not in (None, "") else default)
    except (TypeError, ValueError):
        raise Refused("malformed", f"{keyword} is not an integer") from None


def inspect_instance(data: bytes, sop_instance_uid: str,
                     key: Callable[[str], str]) -> ReceivedInstance:
    """Checks on the encoded instance ``data`` (file meta + dataset) that need no decoding;
    ``Refused`` when it is not a mammogram the node can use (module doc)."""
    try:
        ds = pydicom.dcmread(io.BytesIO(data), stop_before_pixels=True)
        modality = str(ds.get("Modality", "") or "").strip().upper()
        uid = str(ds.get("SOPInstanceUID", "") or "").strip()
    except Exception as e:  # noqa: BLE001 - any parse failure means "cannot understand"
        raise Refused("malformed", type(e).__name__) from None
    if not uid or uid != str(sop_instance_uid).strip():
        raise Refused("malformed", "SOPInstanceUID differs from the request's")
    if modality != "MG":
        raise Refused("wrong_modality", f"Modality {modality[:16]!r} is not MG")
    rows, cols = _int(ds, "Rows", 0), _int(ds, "Columns", 0)
    frames, samples = _int(ds, "NumberOfFrames", 1), _int(ds, "SamplesPerPixel", 1)
    bits = _int(ds, "BitsAllocated", 16)
    if not (0 < rows <= MAX_SIDE and 0 < cols <= MAX_SIDE) or frames != 1 or samples != 1 \
            or bits not in (8, 16):
        raise Refused("bad_dimensions", f"Rows x Columns x frames x samples = {rows} x {cols} "
                      f"x {frames} x {samples}, BitsAllocated {bits}")
    if rows * cols > MAX_PIXELS:
        raise Refused("bad_dimensions", f"{rows} x {cols} pixels exceeds {MAX_PIXELS}")
    decoded = rows * cols * bits // 8
    syntax = ds.file_meta.get("TransferSyntaxUID", ExplicitVRLittleEndian)
    if syntax.is_compressed or syntax.is_deflated:
        if decoded > _RATIO_CHECK_BYTES and decoded > MAX_COMPRESSION_RATIO * len(data):
            raise Refused("decompression_bomb", f"{decoded} decoded bytes from {len(data)}")
    elif len(data) < decoded:
        raise Refused("truncated", f"{len(data)} bytes for {decoded} bytes of pixels")
    return ReceivedInstance(study=study_key(ds, key), instance=key(uid), view=instance_view(ds))


@dataclasses.dataclass(frozen=True)
class AllowEntry:
    """A calling AE title allowed in, optionally only from ``address``."""

    ae_title: str
    address: Optional[str] = None

    @classmethod
    def parse(cls, spec: str) -> "AllowEntry":
        aet, _, addr = spec.partition("@")
        aet = aet.strip()
        if not aet or len(aet) > 16:
            raise ValueError(f"--allow {spec!r}: an AE title is 1 to 16 characters")
        return cls(aet, addr.strip() or None)

    def matches(self, aet: str, address: str) -> bool:
        return aet.strip() == self.ae_title and (self.address is None or address == self.address)


def _is_loopback(address):
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class _AssociationLog:
    """Per-association counts, logged as one line when the connection closes."""

    def __init__(self, aet, address):
        self.aet, self.address, self.t0 = aet, address, time.monotonic()
        self.stored = self.duplicate = self.refused = 0
        self.slowest = 0.0  # s, the longest C-STORE handling (header check + durable write)
        self.how = "closed"  # released | aborted | closed (connection lost)


class StoreSCP:
    """pynetdicom AE serving C-ECHO and C-STORE into ``spool``; ``on_stored(instance, new)``
    is called after each successful store (``new``: not a re-send)."""

    def __init__(self, ae_title: str, host: str, port: int, spool: Spool, status: NodeStatus,
                 on_stored: Callable[[ReceivedInstance, bool], None],
                 allow: Sequence[AllowEntry] = (), ssl_context=None, min_free_bytes: int = 0,
                 max_associations: int = 16):
        self.ae_title, self.host, self.port = ae_title, host, int(port)
        self.spool, self.status, self.on_stored = spool, status, on_stored
        self.allow = tuple(allow)
        self.ssl_context = ssl_context
        self.min_free_bytes = int(min_free_bytes)
        self._open = {}
        self._lock = threading.Lock()
        self._server = None
        self.ae = AE(ae_title=ae_title)
        self.ae.maximum_associations = int(max_associations)
        self.ae.add_supported_context(Verification)
        for sop_class in MAMMOGRAPHY_STORAGE:
            self.ae.add_supported_context(sop_class, list(TRANSFER_SYNTAXES))

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self):
        handlers = [(evt.EVT_REQUESTED, self._on_requested), (evt.EVT_ACCEPTED, self._on_accepted),
                    (evt.EVT_RELEASED, self._on_ended), (evt.EVT_ABORTED, self._on_ended),
                    (evt.EVT_CONN_CLOSE, self._on_closed), (evt.EVT_C_ECHO, self._on_echo),
                    (evt.EVT_C_STORE, self._on_store)]
        self._server = self.ae.start_server((self.host, self.port), block=False,
                                            evt_handlers=handlers, ssl_context=self.ssl_context)
        self.port = self._server.server_address[1]  # the bound port (0 = any free one)
        logger.info("DICOM node %s listening on %s:%d (%s, allow: %s)", self.ae_title, self.host,
                    self.port, "TLS" if self.ssl_context else "no TLS",
                    ", ".join(e.ae_title + (f"@{e.address}" if e.address else "")
                              for e in self.allow) or "loopback only")

    def stop(self):
        if self._server is not None:
            self._server.shutdown()
            self._server = None

    @property
    def open_associations(self) -> int:
        with self._lock:
            return len(self._open)

    # -- association events -------------------------------------------------------------------
    def allowed(self, aet: str, address: str) -> bool:
        if not self.allow:
            return _is_loopback(address)
        return any(e.matches(aet, address) for e in self.allow)

    def _on_requested(self, event):
        aet = str(event.assoc.requestor.primitive.calling_ae_title).strip()
        address = event.assoc.requestor.address
        if not self.allowed(aet, address):
            self.status.count("associations", "rejected")
            logger.warning("association rejected: calling AE %r from %s is not allowed", aet,
                           address)
            event.assoc.acse.send_reject(0x01, 0x01, 0x03)  # calling AE title not recognised
            event.assoc.kill()  # waits until the reject went out (as pynetdicom's own rejects)

    def _on_accepted(self, event):
        with self._lock:
            self._open[id(event.assoc)] = _AssociationLog(
                str(event.assoc.requestor.ae_title).strip(), event.assoc.requestor.address)
        self.status.count("associations", "accepted")

    def _on_ended(self, event):
        self._log_of(event.assoc).how = "released" if event.event is evt.EVT_RELEASED \
            else "aborted"

    def _on_closed(self, event):
        with self._lock:
            log = self._open.pop(id(event.assoc), None)
        if log is None:  # rejected, or never negotiated
            return
        logger.info("association from %s@%s %s after %.1f s: %d stored, %d already stored, "
                    "%d refused, slowest store %.2f s", log.aet, log.address, log.how,
                    time.monotonic() - log.t0, log.stored, log.duplicate, log.refused, log.slowest)

    def _log_of(self, assoc):
        with self._lock:
            return self._open.get(id(assoc)) or _AssociationLog("?", "?")

    @staticmethod
    def _on_echo(event):
        return STATUS_SUCCESS

    def _on_store(self, event):
        t0 = time.monotonic()
        log = self._log_of(event.assoc)
        try:
            return self._store(event, log)
        finally:
            log.slowest = max(log.slowest, time.monotonic() - t0)

    def _store(self, event, log):
        try:
            free = self.spool.free_bytes() if self.min_free_bytes else None
            if free is not None and free < self.min_free_bytes:
                raise OSError(f"{free >> 20} MB free, below the configured minimum "
                              f"{self.min_free_bytes >> 20} MB")
            data = event.encoded_dataset(include_meta=True)
            received = inspect_instance(data, event.request.AffectedSOPInstanceUID,
                                        self.spool.key)
            new = self.spool.store(received.study, received.instance, data)
        except Refused as e:
            log.refused += 1
            self.status.count("instances", f"refused_{e.reason}")
            logger.warning("instance from %s refused (0xC000): %s", log.aet, e)
            return STATUS_CANNOT_UNDERSTAND
        except OSError as e:  # full disk, I/O error: the sender keeps its copy and retries
            log.refused += 1
            self.status.count("instances", "refused_out_of_resources")
            logger.error("instance from %s not stored (0xA700): %s", log.aet,
                         str(e).splitlines()[0][:200])
            return STATUS_OUT_OF_RESOURCES
        if new:
            log.stored += 1
        else:
            log.duplicate += 1
        self.status.count("instances", "stored" if new else "already_stored")
        self.on_stored(received, new)
        return STATUS_SUCCESS
