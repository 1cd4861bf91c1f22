"""Breast / exam malignancy scores (max detection score) and their AUC, by hand."""
import itertools
import json

import pytest
import torch
from detectron2.data import DatasetCatalog
from detectron2.structures import Boxes, Instances

from braixdet.evaluation import MammoDetectionEvaluator
from braixdet.evaluation.exam_scores import breast_exam_auc, breast_exam_scores, image_score


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
