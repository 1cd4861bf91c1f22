"""The node's on-disk state: received instances, committed result versions and the outbox.

Layout under the spool folder (every name a pseudonym: no UID, ID or name appears in a path)::

    incoming/<study>/<instance>.dcm   each received instance, as the sender encoded it
    results/<study>/v<k>/             version k of the study's results, committed by a rename:
        manifest.json                 the instances it covers and the SRs it holds (their UIDs)
        *.dcm                         SR / GSPS files not yet acknowledged by the destination
    status.json                       counts (``node/status.py``)

``<study>`` and ``<instance>`` are ``Spool.key(...)`` digests of the node's study key and the SOP
Instance UID: an HMAC under the spool's own secret (``.key``, mode 0600, made at the first
start), so a pseudonym in a path or a log line cannot be traced back to a PatientID by
enumeration without that file, and stays the same across restarts.
A received instance is written with ``utils.io.atomic_write`` (temporary file,
fsync, rename, fsync of the folder) before the SCP answers success, so an acknowledged instance
survives a kill; the same SOP Instance UID again finds its file and is not written twice.

A result version is written into a hidden staging folder and renamed to ``v<k>`` last: a kill
before the rename leaves no version (the study is processed again at the next start, into the
same k), a kill after it leaves a complete one. The outbox is the ``*.dcm`` files of committed
versions; the sender deletes each one when the destination acknowledged it, the manifest stays as
the record that the version exists.
"""
import hashlib
import hmac
import json
import os
import shutil
import threading
from typing import Dict, List, Optional

from ..utils.io import atomic_write, atomic_write_bytes, atomic_write_json, fsync_dir

__all__ = ["OutboxItem", "Spool"]

_SECRET_FILE = ".key"


def _spool_secret(root: str) -> bytes:
    """The spool's HMAC key: read, or made once (O_EXCL, never through a planted link)."""
    path = os.path.join(root, _SECRET_FILE)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            secret = f.read()
        if len(secret) < 32:
            raise ValueError(f"{path}: spool secret shorter than 32 bytes") from None
        return secret
    secret = os.urandom(32)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
        f.flush()
        os.fsync(f.fileno())
    return secret


class OutboxItem:
    """One result file waiting for its acknowledgement."""

    __slots__ = ("path", "study", "version", "name")

    def __init__(self, path, study, version, name):
        self.path, self.study, self.version, self.name = path, study, version, name

    @property
    def kind(self):
        return "SR" if self.name.startswith("sr_") else "GSPS"


class Spool:
    """Thread-safe access to the layout above."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.incoming = os.path.join(self.root, "incoming")
        self.results = os.path.join(self.root, "results")
        for d in (self.incoming, self.results):
            os.makedirs(d, exist_ok=True)
        self._secret = _spool_secret(self.root)
        # striped locks: two associations storing the same instance at once write it once
        self._locks = [threading.Lock() for _ in range(64)]

    def key(self, text: str) -> str:
        """Path-safe pseudonym of an identifier: 32 hex chars of HMAC-SHA256 under the secret."""
        return hmac.new(self._secret, str(text).encode("utf-8"), hashlib.sha256).hexdigest()[:32]

    # -- instances ----------------------------------------------------------------------------
    def instance_path(self, study: str, instance: str) -> str:
        return os.path.join(self.incoming, study, instance + ".dcm")

    def _write_instance(self, f, data: bytes):
        """Write the received bytes (one place, so a test can inject a full disk)."""
        f.write(data)

    def store(self, study: str, instance: str, data: bytes) -> bool:
        """Write one received instance durably; False when it was already stored (a re-send).
        A failed write (full disk) raises ``OutputWriteError`` and leaves no file behind."""
        path = self.instance_path(study, instance)
        with self._locks[int(instance[:4], 16) % len(self._locks)]:
            if os.path.isfile(path):
                return False
            atomic_write(path, lambda f: self._write_instance(f, data))
        return True

    def studies(self) -> List[str]:
        return sorted(d for d in os.listdir(self.incoming) if not d.startswith("."))

    def instances(self, study: str) -> Dict[str, str]:
        """{instance key: path} of the stored instances of ``study``."""
        folder = os.path.join(self.incoming, study)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return {}
        return {n[:-4]: os.path.join(folder, n) for n in sorted(names)
                if n.endswith(".dcm") and not n.startswith(".")}

    # -- result versions ----------------------------------------------------------------------
    def manifests(self, study: str) -> List[dict]:
        """Committed versions of ``study``, oldest first."""
        folder = os.path.join(self.results, study)
        out = []
        if os.path.isdir(folder):
            for name in os.listdir(folder):
                if name.startswith("v") and name[1:].isdigit():
                    with open(os.path.join(folder, name, "manifest.json"), encoding="utf-8") as f:
                        out.append(json.load(f))
        return sorted(out, key=lambda m: m["version"])

    def commit(self, study: str, version: int, files: Dict[str, bytes], manifest: dict):
        """Write version ``version`` of ``study``: ``files`` {name: DICOM bytes} and the
        manifest, in a staging folder renamed into place last."""
        folder = os.path.join(self.results, study)
        final = os.path.join(folder, f"v{version}")
        staging = os.path.join(folder, f".v{version}.staging")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        for name, data in files.items():
            atomic_write_bytes(os.path.join(staging, name), data)
        atomic_write_json(os.path.join(staging, "manifest.json"), {**manifest, "version": version})
        os.rename(staging, final)  # the commit: fails if the version exists (never overwritten)
        fsync_dir(folder)

    def outbox(self) -> List[OutboxItem]:
        """Result files of committed versions not yet acknowledged, oldest version first, the
        SR of a version before its presentation states."""
        items = []
        for study in sorted(os.listdir(self.results)):
            folder = os.path.join(self.results, study)
            for v in os.listdir(folder):
                if not (v.startswith("v") and v[1:].isdigit()):
                    continue
                for name in os.listdir(os.path.join(folder, v)):
                    if name.endswith(".dcm") and not name.startswith("."):
                        items.append(OutboxItem(os.path.join(folder, v, name), study,
                                                int(v[1:]), name))
        return sorted(items, key=lambda i: (os.path.getmtime(os.path.dirname(i.path)),
                                            i.study, i.version, not i.name.startswith("sr_"),
                                            i.name))

    @staticmethod
    def acknowledge(item: OutboxItem):
        """The destination has the file: it leaves the outbox (the manifest stays)."""
        os.unlink(item.path)

    # -- restart ------------------------------------------------------------------------------
    def clean_partial(self) -> int:
        """Remove what a kill left half-written: temporary instance files and staging folders
        of uncommitted versions. Returns how many."""
        n = 0
        for base in (self.incoming, self.results):
            for study in os.listdir(base):
                folder = os.path.join(base, study)
                if not os.path.isdir(folder):
                    continue
                for name in os.listdir(folder):
                    path = os.path.join(folder, name)
                    if name.endswith(".staging") and os.path.isdir(path):
                        shutil.rmtree(path, ignore_errors=True)
                        n += 1
                    elif name.startswith(".") and name.endswith(".tmp"):
                        os.unlink(path)
                        n += 1
        return n

    def free_bytes(self) -> Optional[int]:
        try:
            return shutil.disk_usage(self.root).free
        except OSError:
            return None
