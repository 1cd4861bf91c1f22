"""Issue 29 items 6-14: the DICOM outputs of tools/predict.py as viewers and PACS read them,
de-identification, identifiers off the console and report.json, and what predict.py does with
--out (planted links, stale files) and SIGTERM. Synthetic files are crafted to be hostile."""
import json
import os
import shutil
import signal
import sys
import time
import warnings

import numpy as np
import pydicom
import pytest
import torch
from detectron2.structures import Boxes, Instances
from pydicom.pixels import apply_modality_lut, apply_voi_lut

from braixdet.data.dicom import pseudonymise, read_dicom_meta
from braixdet.data.report import BadInputReport
from braixdet.inference import outputs as predict_outputs
from braixdet.inference.deidentify import PseudonymMap
from braixdet.inference.predictor import Exam, ImagePrediction, assign_record_ids
from braixdet.inference.sr import exam_sr, image_presentation_state, read_sr_findings
from braixdet.utils.io import OutputPathRefused

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = ["INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)", "INPUT.BRAIXDET.MASK_DOWNSAMPLE", "2"]
CFG = os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml")


def _truth(synthetic_root, **match):
    return [r for r in synthetic_root.summary["truth"]
            if all(r[k] == v for k, v in match.items())]


def _path(synthetic_root, rec):
    return os.path.join(synthetic_root.root, rec["path"])


# -- items 6 and 7: what a viewer shows ------------------------------------------------------------
def _own_display(ds):
    """The image as its own header says to show it, brighter = larger (PS3.4 N.2)."""
    arr = apply_voi_lut(apply_modality_lut(ds.pixel_array, ds), ds).astype(np.float64)
    return arr.max() - arr if ds.PhotometricInterpretation == "MONOCHROME1" else arr


def _through_state(pr, ds):
    """The image rendered through a presentation state (modality LUT -> softcopy VOI LUT
    window -> presentation LUT shape, PS3.4 N.2), brighter = larger."""
    arr = ds.pixel_array.astype(np.float64)
    if "RescaleSlope" in pr:
        arr = arr * float(pr.RescaleSlope) + float(pr.RescaleIntercept)
    voi = pr.get("SoftcopyVOILUTSequence")
    if voi and "WindowCenter" in voi[0]:
        c, w = float(voi[0].WindowCenter), float(voi[0].WindowWidth)
        arr = np.clip((arr - (c - 0.5)) / (w - 1) + 0.5, 0, 1)
    else:
        arr = (arr - arr.min()) / max(np.ptp(arr), 1e-9)
    return 1.0 - arr if pr.PresentationLUTShape == "INVERSE" else arr


@pytest.mark.parametrize("photometric", ["MONOCHROME1", "MONOCHROME2"])
def test_gsps_renders_like_the_image_and_names_its_side(synthetic_root, tmp_path, photometric):
    """Item 7: rendered through its GSPS, an image looks as it does on its own (correlation
    ~ +1, a negative would be -1); item 6: the GSPS carries the image's Laterality (General
    Series, Type 2C; here from the image's tags, predict.py passes the resolved side)."""
    rec = _truth(synthetic_root, photometric=photometric, split="test")[0]
    path = _path(synthetic_root, rec)
    pr = image_presentation_state(path, [[1, 2, 30, 40]], [0.9], score_thresh=0.5)
    pydicom.dcmwrite(tmp_path / "pr.dcm", pr, enforce_file_format=True)
    pr = pydicom.dcmread(tmp_path / "pr.dcm")
    ds = pydicom.dcmread(path)
    corr = np.corrcoef(_through_state(pr, ds).ravel(), _own_display(ds).ravel())[0, 1]
    assert corr > 0.99, (photometric, pr.PresentationLUTShape, corr)
    assert pr.Laterality == rec["laterality"]


# -- item 8: one output per record -----------------------------------------------------------------
def test_record_ids_stay_unique_beside_a_crafted_dup_uid(synthetic_root):
    """Two files with UID X and a third whose UID is literally "X_dup2": three ids, so three
    PNGs and three GSPS (the suffix never lands on a UID that a file carries)."""
    rec = _truth(synthetic_root, split="test")[0]
    meta = read_dicom_meta(_path(synthetic_root, rec))
    uid = meta.sop_uid
    metas = [meta.__class__(**{**meta.__dict__, "path": f"/in/{name}", "sop_uid": u})
             for name, u in (("a.dcm", uid), ("b.dcm", uid), ("0.dcm", f"{uid}_dup2"))]
    report = BadInputReport()
    (exam,) = assign_record_ids([Exam(study_uid="s", images=tuple(metas))], report)
    ids = [exam.record_id(i) for i in range(3)]
    assert len(set(ids)) == 3 and ids[2] == f"{uid}_dup2", ids
    assert report.counts["duplicate_sop_uid"] == 1


# -- item 9: a source file gone before its SR ------------------------------------------------------
def _prediction(path, record_id):
    meta = read_dicom_meta(path)
    inst = Instances((int(meta.rows), int(meta.cols)))
    inst.pred_boxes = Boxes(torch.tensor([[2.0, 3.0, 20.0, 30.0]]))
    inst.scores = torch.tensor([0.8])
    inst.pred_classes = torch.tensor([0])
    return ImagePrediction(meta=meta, aux_sop_uid=meta.sop_uid, aux_missing=True,
                           instances=inst, record_id=record_id)


def _exam_files(synthetic_root, tmp_path, name="in"):
    """The 4 images of one synthetic test patient, copied to ``tmp_path/name``."""
    patient = _truth(synthetic_root, split="test")[0]["patient"]
    recs = _truth(synthetic_root, patient=patient)
    assert len(recs) == 4
    folder = tmp_path / name
    folder.mkdir(parents=True)
    files = []
    for i, rec in enumerate(recs):
        files.append(folder / f"{i}.dcm")
        shutil.copy(_path(synthetic_root, rec), files[-1])
    return files


def test_vanished_source_file_costs_only_its_own_outputs(synthetic_root, tmp_path):
    """Item 9: one of four files deleted after prediction: the SR of the other three and their
    three GSPS are written; the missing one is one ``sr_source_missing`` line naming it."""
    files = _exam_files(synthetic_root, tmp_path)
    preds = [_prediction(str(f), f"r{i}") for i, f in enumerate(files)]
    os.unlink(files[1])
    out = tmp_path / "out"
    out.mkdir()
    report = predict_outputs._InputRelativeReport("t", [str(tmp_path / "in")], out)
    outputs = predict_outputs._Outputs(out)
    predict_outputs._write_sr(preds, {"L": 0.8, "R": 0.8}, 0.8, 0, outputs, 0.5, None, report)
    outputs.close()
    assert sorted(p.name for p in (out / "pr").iterdir()) == ["r0.dcm", "r2.dcm", "r3.dcm"]
    found = {f["sop_instance_uid"] for f in read_sr_findings(out / "sr" / "exam_0.dcm")}
    assert found == {preds[i].meta.sop_uid for i in (0, 2, 3)}
    assert report.errors == [{"path": "1.dcm", "reason": "sr_source_missing",
                              "detail": "exam 0: not in its SR, no presentation state "
                                        "(FileNotFoundError)"}]


# -- item 10: de-identification --------------------------------------------------------------------
def test_pseudonymised_sr_and_gsps_follow_the_basic_profile(synthetic_root, tmp_path):
    """Item 10: one exam's SR and 4 GSPS share one random pseudonym (in the user's mapping
    file, not computable from the PatientID), a non-empty name and the same replacement UIDs;
    AccessionNumber, ReferringPhysicianName, StudyID (emptied), StudyDescription, private tags
    (removed) and every source UID are gone from all five files; the map is reused."""
    files = _exam_files(synthetic_root, tmp_path)
    identifying = set()
    for f in files:
        ds = pydicom.dcmread(f)
        ds.AccessionNumber, ds.ReferringPhysicianName = "ACC-5531", "Who^Doctor"
        ds.StudyID, ds.StudyDescription = "SID-8812", "MAMMO Jane Roe"
        ds.add_new(0x00990010, "LO", "ACME")
        ds.add_new(0x00991001, "LO", "PRIV-2290")
        ds.save_as(f)
        identifying |= {str(ds.PatientID), str(ds.PatientName), str(ds.StudyInstanceUID),
                        str(ds.SeriesInstanceUID), str(ds.SOPInstanceUID), "ACC-5531",
                        "Who^Doctor", "SID-8812", "Jane Roe", "PRIV-2290"}
    mapping = tmp_path / "private" / "map.json"
    mapping.parent.mkdir()
    images = [{"path": str(f), "laterality": read_dicom_meta(f).laterality,
               "boxes": [[1, 2, 30, 40]], "scores": [0.9]} for f in files]
    with pytest.raises(ValueError, match="inside --out"):
        PseudonymMap(tmp_path / "out" / "map.json", out_dir=tmp_path / "out")
    with PseudonymMap(mapping, out_dir=tmp_path / "out") as pm:
        written = [exam_sr(images, {"L": 0.9}, 0.9, score_thresh=0.5, pseudonyms=pm)]
        first = pydicom.dcmread(files[0])
        written += [image_presentation_state(
            im["path"], im["boxes"], im["scores"], score_thresh=0.5, pseudonyms=pm,
            header=pm.header(pydicom.dcmread(im["path"], stop_before_pixels=True), first))
            for im in images]
    assert oct(mapping.stat().st_mode & 0o777) == "0o600"
    hexid = json.loads(mapping.read_text())["patients"][str(first.PatientID)]
    assert hexid != pseudonymise(str(first.PatientID))[: len(hexid)]
    refs = []
    for i, ds in enumerate(written):
        pydicom.dcmwrite(tmp_path / f"{i}.dcm", ds, enforce_file_format=True)
        raw = (tmp_path / f"{i}.dcm").read_bytes()
        assert not [v for v in identifying if v.encode() in raw], i
        ds = pydicom.dcmread(tmp_path / f"{i}.dcm")
        assert (ds.PatientID, str(ds.PatientName)) == (f"BXD-{hexid}", f"BRAIXDET^{hexid}")
        assert ds.PatientIdentityRemoved == "YES"
        assert ds.DeidentificationMethodCodeSequence[0].CodeValue == "113100"
        assert (ds.AccessionNumber, ds.ReferringPhysicianName, ds.StudyID) == ("", "", "")
        assert "StudyDescription" not in ds and "PatientBirthDate" not in ds or \
            ds.PatientBirthDate == ""
        if i:
            refs.append(ds.GraphicAnnotationSequence[0].ReferencedImageSequence[0]
                        .ReferencedSOPInstanceUID)
    sr_refs = {f["sop_instance_uid"] for f in read_sr_findings(tmp_path / "0.dcm")}
    assert sr_refs == set(refs) and len(refs) == 4  # the same replacement UIDs in all five
    again = PseudonymMap(mapping)  # a later run: the same pseudonym and UIDs
    try:
        assert again.header(first).PatientID == f"BXD-{hexid}"
        assert again.header(first).SOPInstanceUID in sr_refs
    finally:
        again.close()


# -- items 11-14: through tools/predict.py ---------------------------------------------------------
@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from detectron2.modeling import build_model

    from braixdet.config import build_cfg
    from braixdet.utils.checkpoint import export_model_only

    cfg = build_cfg(CFG, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "",
                          "MODEL.BRAIXDET.PRETRAINED", "", *SIZE])
    path = str(tmp_path_factory.mktemp("w") / "w.pth")
    export_model_only(build_model(cfg), path)
    return path


@pytest.fixture
def predict(load_tool):
    """tools/predict.py's main() on the tiny model: (weights, input, out, *flags) -> records."""
    def run(weights, inp, out, *extra):
        return load_tool("predict").main([
            "--config-file", CFG, "--weights", weights, "--input", str(inp), "--out", str(out),
            "--workers", "0", *extra, "MODEL.BRAIXDET.PRETRAINED", "", *SIZE])
    return run


def _print_warning(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def test_identifiers_stay_off_console_and_report(synthetic_root, tmp_path, weights, capfd,
                                                 predict):
    """Item 11: an input folder named after a record number and a header value pydicom quotes
    in its warnings: neither reaches stdout/stderr or report.json (paths are relative to
    --input); item 13: a second run into the same --out removes the first run's outputs that
    are not its own, and nothing else."""
    inp = tmp_path / "MRN-7741"
    files = _exam_files(synthetic_root, inp, name="exam")
    ds = pydicom.dcmread(files[0])
    ds.SeriesInstanceUID = "MRN-7741.series"  # not a UID: pydicom's warning quotes it
    ds.save_as(files[0])
    (inp / "exam" / "junk.dcm").write_bytes(b"not dicom")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    capfd.readouterr()
    with warnings.catch_warnings():  # as outside pytest: every warning printed on stderr
        warnings.simplefilter("always")
        warnings.showwarning = _print_warning
        predict(weights, inp, out, "--format", "both", "--score-thresh", "0.999")
    console = "".join(capfd.readouterr())
    report = (out / "report.json").read_text()
    assert "MRN-7741" not in console + report, (console + report)[-3000:]
    paths = {e["path"] for e in json.loads(report)["errors"]}
    assert os.path.join("exam", "junk.dcm") in paths, paths  # (0.dcm too, if UIDs are checked)
    assert paths <= {os.path.join("exam", "junk.dcm"), os.path.join("exam", "0.dcm")}, paths
    first = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
    assert len([p for p in first if p.parent.name == "pr"]) >= 3

    other = _exam_files(synthetic_root, tmp_path, name="second")[:2]
    for f in other:  # another patient: nothing of the first run may stay beside it
        ds = pydicom.dcmread(f)
        ds.PatientID, ds.SOPInstanceUID = "OTHER-1", pydicom.uid.generate_uid()
        ds.save_as(f)
    result = predict(weights, tmp_path / "second", out, "--format", "both",
                      "--score-thresh", "0.999")
    now = {p.relative_to(out) for p in out.rglob("*") if p.is_file()}
    pngs = {p.name for p in now if p.suffix == ".png" and p.parent == out.relative_to(out)}
    assert pngs == {f"{r['record_id']}.png" for r in result}
    assert {p.stem for p in now if p.parent.name == "pr"} == {r["record_id"] for r in result}
    assert (out / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("sub", ["sr", "pr", "exams"])
def test_planted_output_subfolder_link_is_refused(tmp_path, weights, sub, predict):
    """Item 12: --out/<sub> a symbolic link to a folder outside: one-line refusal before any
    prediction, nothing written through it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(outside, out / sub)
    with pytest.raises(OutputPathRefused, match=f"{sub}: it is a symbolic link"):
        predict(weights, tmp_path / "nothing", out, "--format", "both")
    assert not list(outside.iterdir())


def test_sigterm_leaves_no_cache_of_patient_images(synthetic_root, tmp_path, weights,
                                                   monkeypatch, predict):
    """Item 14: SIGTERM while predict.py predicts: it exits with status 143 (SystemExit, so
    the ``with`` blocks run) and its temporary cache folder of canonical images is gone.
    (In this process: the test's own SIGTERM handler stands for the default action, death
    without cleanup, and tells the two apart.)"""
    import tempfile
    import threading

    inp = tmp_path / "in"
    inp.mkdir()
    for i, rec in enumerate(synthetic_root.summary["truth"][:12]):
        shutil.copy(_path(synthetic_root, rec), inp / f"{i}.dcm")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))

    def caches():
        return [p for p in tmp.iterdir() if p.name.startswith("braixdet-predict-cache-")]

    def send_when_cached():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(any(p.iterdir()) for p in caches()):  # canonical images are on disk
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.005)

    class Unhandled(Exception):
        pass

    def default_action(signum, frame):
        raise Unhandled("SIGTERM reached the default action: the process would die here")

    previous = signal.signal(signal.SIGTERM, default_action)
    sender = threading.Thread(target=send_when_cached, daemon=True)
    sender.start()
    try:
        with pytest.raises(SystemExit) as stopped:
            predict(weights, inp, tmp_path / "out", "--no-overlays")
    finally:
        signal.signal(signal.SIGTERM, previous)
        sender.join(5)
    assert stopped.value.code == 128 + signal.SIGTERM
    assert not caches()
