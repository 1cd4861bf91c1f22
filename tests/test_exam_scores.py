"""Breast / exam malignancy scores (max detection score) and their AUC, by hand."""
import itertools
import json

import pytest
import torch
from detectron2.data import DatasetCatalog
from detectron2.structures import Boxes, Instances

from braixdet.evaluation import MammoDetectionEvaluator
from braixdet.evaluation.exam_scores import (
    breast_exam_auc,
    breast_exam_scores,
    image_score,
    paired_view_rescore,
)


def _auc_by_hand(pos, neg):
    """P(score of a positive > score of a negative), ties count one half."""
    pairs = list(itertools.product(pos, neg))
    return sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in pairs) / len(pairs)


# 3 exams x 2 breasts x (CC, MLO); label 1 = malignant image
RECORDS = {f"{e}{lat}{v}": {"exam_id": e, "laterality": lat, "label": lab}
           for (e, lat, v), lab in zip(itertools.product("abc", "LR", ("CC", "MLO")),
                                       [1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1])}
SCORES = {"aLCC": [0.9, 0.2], "aLMLO": [0.3], "aRCC": [], "aRMLO": [0.4],
          "bLCC": [0.5], "bLMLO": [0.1], "bRCC": [0.95], "bRMLO": [],
          "cLCC": [0.6], "cLMLO": [], "cRCC": [0.2], "cRMLO": [0.35]}


def test_scores_and_auc_by_hand():
    assert image_score([]) == 0.0 and image_score([0.2, 0.7]) == 0.7
    breasts, exams = breast_exam_scores(
        (RECORDS[i]["exam_id"], RECORDS[i]["laterality"], image_score(s))
        for i, s in SCORES.items())
    assert breasts == {("a", "L"): 0.9, ("a", "R"): 0.4, ("b", "L"): 0.5, ("b", "R"): 0.95,
                       ("c", "L"): 0.6, ("c", "R"): 0.35}
    assert exams == {"a": 0.9, "b": 0.95, "c": 0.6}
    breast_auc, exam_auc, nb, ne = breast_exam_auc(
        RECORDS, {i: image_score(s) for i, s in SCORES.items()})
    # malignant breasts: aL (0.9), cR (0.35); malignant exams: a (0.9), c (0.6)
    assert breast_auc == pytest.approx(_auc_by_hand([0.9, 0.35], [0.4, 0.5, 0.95, 0.6]))
    assert exam_auc == pytest.approx(_auc_by_hand([0.9, 0.6], [0.95]))
    assert (nb, ne) == (6, 3)


def test_evaluator_reports_breast_and_exam_auc(tmp_path):
    """MammoDetectionEvaluator: the AUCs (percent) in its results and metrics.json."""
    name = "braixdet_test_exam_scores"
    DatasetCatalog.register(name, lambda: [{"image_id": i, "height": 100, "width": 80, **r}
                                           for i, r in RECORDS.items()])
    try:
        ev = MammoDetectionEvaluator(name, output_dir=str(tmp_path), distributed=False,
                                     save_plots=False)
        ev.reset()
        for i, s in SCORES.items():
            inst = Instances((100, 80))
            inst.pred_boxes = Boxes(torch.tensor([[1.0, 1.0, 10.0, 10.0]] * len(s)).reshape(-1, 4))
            inst.scores = torch.tensor(s, dtype=torch.float32)
            ev.process([{"image_id": i}], [{"instances": inst}])
        res = ev.evaluate()["screening"]
    finally:
        DatasetCatalog.remove(name)
    assert res["breast_AUC"] == pytest.approx(
        100 * _auc_by_hand([0.9, 0.35], [0.4, 0.5, 0.95, 0.6]), abs=1e-4)
    assert res["exam_AUC"] == pytest.approx(100 * _auc_by_hand([0.9, 0.6], [0.95]), abs=1e-4)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["breast_AUC"] == pytest.approx(res["breast_AUC"])


# the other view of the same breast (data/pairing.py's rule)
PARTNER = {i: i[:2] + ("MLO" if i.endswith("CC") else "CC") for i in RECORDS}


def test_paired_view_rescore_by_hand():
    """Each score × the partner's top score: 0 when the partner has no box; an image without a
    partner, or whose partner was not predicted, is its own partner."""
    out = paired_view_rescore(SCORES, PARTNER)
    assert out["aLCC"] == pytest.approx([0.9 * 0.3, 0.2 * 0.3])
    assert out["aLMLO"] == pytest.approx([0.3 * 0.9])
    assert list(out["aRMLO"]) == [0.0] and len(out["aRCC"]) == 0  # aRCC has no box
    assert out["bRCC"] == pytest.approx([0.0])
    alone = paired_view_rescore({"x": [0.5, 0.2], "y": [0.4]}, {"y": "z"})
    assert alone["x"] == pytest.approx([0.25, 0.1]) and alone["y"] == pytest.approx([0.16])


def _evaluate(tmp_path, name, scores, **kwargs):
    DatasetCatalog.register(name, lambda: [
        {"image_id": i, "height": 100, "width": 80, "aux_image_id": PARTNER[i], **r,
         "annotations": [{"bbox": [0.0, 0.0, 12.0, 12.0], "bbox_mode": 0}] if r["label"] else []}
        for i, r in RECORDS.items()])
    try:
        ev = MammoDetectionEvaluator(name, output_dir=str(tmp_path), distributed=False,
                                     save_plots=False, **kwargs)
        ev.reset()
        for i, s in scores.items():
            inst = Instances((100, 80))
            inst.pred_boxes = Boxes(torch.tensor([[1.0, 1.0, 10.0, 10.0], [50.0, 50.0, 70.0, 90.0]]
                                                 [:len(s)]).reshape(-1, 4))
            inst.scores = torch.tensor(s, dtype=torch.float32)
            ev.process([{"image_id": i}], [{"instances": inst}])
        return ev.evaluate()
    finally:
        DatasetCatalog.remove(name)


def test_evaluator_paired_view_rescore(tmp_path):
    """TEST.BRAIXDET.PAIRED_VIEW_RESCORE: the evaluator scores, saves and reports the boxes as
    if the detector had given the rescored scores (partners from the dicts' aux_image_id)."""
    from braixdet.config import ConfigValueError, build_cfg

    on = _evaluate(tmp_path / "on", "braixdet_test_rescore_on", SCORES, paired_view_rescore=True)
    by_hand = {i: [float(v) for v in s] for i, s in paired_view_rescore(SCORES, PARTNER).items()}
    ref = _evaluate(tmp_path / "ref", "braixdet_test_rescore_ref", by_hand)
    plain = _evaluate(tmp_path / "off", "braixdet_test_rescore_off", SCORES)
    assert on["bbox"] == pytest.approx(ref["bbox"], abs=1e-4)
    assert on["screening"] == pytest.approx(ref["screening"], abs=1e-4)
    assert on["bbox"]["AP20"] != pytest.approx(plain["bbox"]["AP20"], abs=1e-3)
    saved = json.loads((tmp_path / "on" / "detections_coco.json").read_text())
    assert sorted(d["score"] for d in saved) == pytest.approx(
        sorted(v for s in by_hand.values() for v in s), abs=1e-6)
    assert json.loads((tmp_path / "on" / "metrics.json").read_text())["paired_view_rescore"]
    with pytest.raises(ConfigValueError, match="PAIRED_VIEW_RESCORE"):
        build_cfg("", ["TEST.BRAIXDET.PAIRED_VIEW_RESCORE", "True",
                       "MODEL.META_ARCHITECTURE", "MVCCLClassifier"])
