"""Evaluation: AP == pycocotools COCOeval, FROC hand-made cases, evaluators, tools, overlays."""
import contextlib
import csv
import io
import json
import os
import uuid
import warnings

import cv2
import numpy as np
import pytest
import torch
from detectron2.data import DatasetCatalog
from detectron2.structures import Boxes, BoxMode, Instances
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from scipy import stats
from sklearn.metrics import log_loss, roc_auc_score

from braixdet.evaluation import (
    ClassificationEvaluator,
    MammoDetectionEvaluator,
    average_precision,
    box_iou_coco,
    build_evaluator,
    froc,
)
from braixdet.evaluation.metrics import match_detections
from braixdet.inference.visualize import DET_COLOR, GT_COLOR, draw_overlay

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- pycocotools reference ---------------------------------------------------------------------
def coco_ap(gts, dets, iou_thresh=0.2, max_dets=100):
    """AP from COCOeval on the same data (ids: the dict keys, ints)."""
    images = sorted(set(gts) | set(dets))
    anns = []
    for i in images:
        for b in np.asarray(gts.get(i, []), dtype=float).reshape(-1, 4):
            w, h = b[2] - b[0], b[3] - b[1]
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": 1,
                         "bbox": [b[0], b[1], w, h], "area": w * h, "iscrowd": 0})
    res = [{"image_id": i, "category_id": 1, "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
            "score": float(s)} for i, (bb, ss) in dets.items() for b, s in zip(bb, ss)]
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": [{"id": i} for i in images], "annotations": anns,
                      "categories": [{"id": 1, "name": "malignant"}]}
        gt.createIndex()
        if not res:  # loadRes refuses an empty list; COCOeval then reports 0 when GT exists
            return 0.0 if anns else float("nan")
        ev = COCOeval(gt, gt.loadRes(res), "bbox")
        ev.params.iouThrs = np.array([iou_thresh])
        ev.params.maxDets = [max_dets]
        ev.params.areaRng = [[0, 1e5**2]]
        ev.params.areaRngLbl = ["all"]
        ev.evaluate()
        ev.accumulate()
    p = ev.eval["precision"][0, :, 0, 0, 0]
    return float(np.mean(p[p > -1])) if (p > -1).any() else float("nan")


def _random_case(rng):
    n = int(rng.integers(1, 25))
    gts, dets = {}, {}
    crowded = rng.random() < 0.4  # overlapping GT boxes: the exact sequential greedy path
    for i in range(1, n + 1):
        ng = int(rng.integers(0, 5)) if rng.random() < 0.75 else 0  # some lesion-free images
        span = 30 if crowded else 200
        xy = rng.uniform(0, span, (ng, 2))
        gts[i] = np.c_[xy, xy + rng.uniform(3, 40, (ng, 2))]
        if rng.random() < 0.2:
            continue  # no detections for this image
        nd = int(rng.integers(0, 130))  # sometimes > max_dets
        xy = rng.uniform(0, span, (nd, 2))
        b = np.c_[xy, xy + rng.uniform(3, 40, (nd, 2))]
        if ng:
            k = rng.integers(0, ng, nd // 2)  # duplicates near lesions
            j = gts[i][k] + rng.normal(0, 3, (len(k), 4))
            j[:, 2:] = np.maximum(j[:, 2:], j[:, :2] + 0.5)
            b[: nd // 2] = j
        s = rng.random(nd)
        if rng.random() < 0.5:
            s = np.round(s, 1)  # ties in score: COCO's stable-sort order matters
        dets[i] = (b, s)
    return gts, dets


@pytest.mark.parametrize("seed", range(24))
def test_ap_matches_pycocotools_random(seed):
    rng = np.random.default_rng(seed)
    gts, dets = _random_case(rng)
    thr = float(rng.choice([0.2, 0.2, 0.5, 0.75]))
    max_dets = int(rng.choice([100, 100, 10, 1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a case may have no GT at all
        ours = average_precision(gts, dets, iou_thresh=thr, max_dets=max_dets)
        ref = coco_ap(gts, dets, thr, max_dets)
    if np.isnan(ref):
        assert np.isnan(ours)
    else:
        assert ours == pytest.approx(ref, abs=1e-6)


def test_iou_has_no_plus_one_like_pycocotools():
    from pycocotools import mask as mask_utils

    rng = np.random.default_rng(0)
    d = np.c_[rng.uniform(0, 50, (7, 2)), rng.uniform(0, 50, (7, 2)) + 50]
    g = np.c_[rng.uniform(0, 50, (5, 2)), rng.uniform(0, 50, (5, 2)) + 50]
    ref = mask_utils.iou(np.c_[d[:, :2], d[:, 2:] - d[:, :2]].tolist(),
                         np.c_[g[:, :2], g[:, 2:] - g[:, :2]].tolist(), [0] * 5)
    np.testing.assert_allclose(box_iou_coco(d, g), ref, rtol=0, atol=1e-12)
    assert box_iou_coco([[0, 0, 10, 10]], [[0, 0, 10, 2]])[0, 0] == pytest.approx(0.2)


@pytest.mark.parametrize("case", ["perfect", "fp_first", "at_threshold", "below_threshold",
                                  "tie_goes_to_last_gt", "max_dets_cut"])
def test_ap_hand_made(case):
    gt = np.array([[0, 0, 10, 10]], dtype=float)
    if case == "perfect":
        gts, dets, thr, md, want = {1: gt}, {1: (gt, [0.9])}, 0.2, 100, 1.0
    elif case == "fp_first":  # FP scored above the TP: precision 0.5 at every recall
        gts = {1: gt, 2: np.zeros((0, 4))}
        dets = {1: (gt, [0.5]), 2: ([[0, 0, 5, 5]], [0.9])}
        thr, md, want = 0.2, 100, 0.5
    elif case == "at_threshold":  # IoU exactly 0.2 counts (>=)
        gts, dets, thr, md, want = {1: gt}, {1: ([[0, 0, 10, 2]], [0.9])}, 0.2, 100, 1.0
    elif case == "below_threshold":
        gts, dets, thr, md, want = {1: gt}, {1: ([[0, 0, 10, 1.9]], [0.9])}, 0.2, 100, 0.0
    elif case == "tie_goes_to_last_gt":
        # det 1 has IoU 0.6 with both GTs and takes the later one (COCO), so det 2 (IoU 1 with
        # the first GT, 1/3 with the second) is a TP too; taking the first GT would give AP 0.5
        gts = {1: np.array([[0, 0, 10, 10], [5, 0, 15, 10]], dtype=float)}
        dets = {1: ([[2.5, 0, 12.5, 10], [0, 0, 10, 10]], [0.9, 0.8])}
        thr, md, want = 0.5, 100, 1.0
    else:  # only the top detection is kept: the TP (lower score) is cut
        gts, dets = {1: gt}, {1: ([[50, 50, 60, 60], [0, 0, 10, 10]], [0.9, 0.1])}
        thr, md, want = 0.2, 1, 0.0
    ours = average_precision(gts, dets, iou_thresh=thr, max_dets=md)
    assert ours == pytest.approx(want, abs=1e-6)
    assert ours == pytest.approx(coco_ap(gts, dets, thr, md), abs=1e-6)


def test_ap_edge_cases():
    gt = {1: np.array([[0, 0, 10, 10]], dtype=float), 2: np.zeros((0, 4))}
    # no GT at all -> NaN with a warning, no crash
    with pytest.warns(RuntimeWarning, match="no ground-truth"):
        assert np.isnan(average_precision({1: np.zeros((0, 4))}, {1: ([[0, 0, 5, 5]], [0.5])}))
    with pytest.warns(RuntimeWarning):
        assert np.isnan(average_precision({}, {}))
    # GT but no predictions (missing key, or an empty array) -> 0
    assert average_precision(gt, {}) == 0.0
    assert average_precision(gt, {1: (np.zeros((0, 4)), np.zeros(0))}) == 0.0
    # zero-area detection inside the lesion is an FP; a zero-area GT is never found
    assert average_precision(gt, {1: ([[2, 2, 2, 8]], [0.9])}) == 0.0
    assert average_precision({1: [[5, 5, 5, 9]]}, {1: ([[4, 4, 6, 10]], [0.9])}) == 0.0
    # detections on an image absent from gts count on a lesion-free image
    ap = average_precision(gt, {1: ([[0, 0, 10, 10]], [0.5]), 9: ([[0, 0, 1, 1]], [0.9])})
    assert ap == pytest.approx(0.5)
    with pytest.raises(ValueError, match="inverted"):
        average_precision(gt, {1: ([[10, 0, 0, 10]], [0.9])})
    with pytest.raises(ValueError, match="scores"):
        average_precision(gt, {1: ([[0, 0, 10, 10]], [0.9, 0.8])})
    with pytest.raises(ValueError):
        average_precision(gt, {1: ([[0, 0, 10, 10]], [np.nan])})


# ---- FROC ----------------------------------------------------------------------------------------
LESION = np.array([[100, 100, 140, 140]], dtype=float)
FAR = [[400, 400, 440, 440]]


def test_froc_far_away_detection_is_fp():
    r = froc({1: LESION}, {1: (FAR, [0.99])})
    assert r["tp"][-1] == 0 and r["fp"][-1] == 1
    assert all(v == 0 for v in r["recall_at_fppi"].values())
    np.testing.assert_allclose(r["fppi"], [0, 1])


def test_froc_duplicate_detections_one_tp_one_fp():
    dup = [[101, 101, 141, 141], [99, 100, 139, 141]]
    r = froc({1: LESION}, {1: (dup, [0.9, 0.8])})
    assert (r["tp"][-1], r["fp"][-1]) == (1, 1)
    np.testing.assert_allclose(r["sensitivity"], [0, 1, 1])
    np.testing.assert_allclose(r["fppi"], [0, 0, 1])
    assert r["recall_at_fppi"][0.25] == 1.0
    assert r["num_lesions"] == 1 and r["num_detections"] == 2


def test_froc_normals_count_in_fppi_denominator():
    gts = {1: LESION, 2: np.zeros((0, 4)), 3: np.zeros((0, 4)), 4: np.zeros((0, 4))}
    dets = {1: ([FAR[0], LESION[0]], [0.9, 0.5]),  # FP above the TP
            2: ([[0, 0, 9, 9]], [0.8]), 3: ([[0, 0, 9, 9]], [0.7]), 4: ([[0, 0, 9, 9]], [0.6])}
    r = froc(gts, dets)
    assert r["num_images"] == 4
    np.testing.assert_allclose(r["fppi"], [0, 0.25, 0.5, 0.75, 1.0, 1.0])
    assert r["recall_at_fppi"] == {0.25: 0.0, 0.5: 0.0, 1: 1.0, 2: 1.0, 4: 1.0}
    # 8 more normal images without any detection: the TP now comes at 4/12 FPPI
    gts.update({k: np.zeros((0, 4)) for k in range(5, 13)})
    r = froc(gts, dets)
    assert r["num_images"] == 12
    assert r["fppi"][-1] == pytest.approx(4 / 12)
    assert r["recall_at_fppi"][0.25] == 0.0 and r["recall_at_fppi"][0.5] == 1.0


def test_froc_center_hit_option():
    gt = {1: np.array([[0, 0, 100, 100]], dtype=float)}
    small = [[40, 40, 60, 60]]  # centre inside, IoU 0.04
    big = [[-100, -100, 300, 300]]  # centre (100, 100) on the border, IoU 0.0625
    shifted = [[60, 0, 160, 100]]  # centre outside, IoU 0.25
    flat = [[40, 50, 60, 50]]  # zero-area, centre inside: never a hit
    for box, iou_tp, centre_tp in [(small, 0, 1), (big, 0, 1), (shifted, 1, 0), (flat, 0, 0)]:
        assert froc(gt, {1: (box, [0.9])})["tp"][-1] == iou_tp, box
        assert froc(gt, {1: (box, [0.9])}, center_hit=True)["tp"][-1] == centre_tp, box
    # two lesions, one box whose centre lies in both: it takes one, the duplicate the other
    two = {1: np.array([[0, 0, 100, 100], [50, 50, 150, 150]], dtype=float)}
    r = froc(two, {1: ([[70, 70, 80, 80], [72, 72, 78, 78]], [0.9, 0.8])}, center_hit=True)
    assert (r["tp"][-1], r["fp"][-1]) == (2, 0)


def test_froc_edge_cases():
    with pytest.warns(RuntimeWarning, match="no ground-truth"):
        r = froc({1: np.zeros((0, 4))}, {1: (FAR, [0.5])})
    assert all(np.isnan(v) for v in r["recall_at_fppi"].values())
    r = froc({1: LESION, 2: np.zeros((0, 4))}, {})
    assert r["recall_at_fppi"][4] == 0.0 and r["num_images"] == 2
    np.testing.assert_allclose(r["fppi"], [0])
    # equal scores: one operating point per distinct threshold
    r = froc({1: LESION}, {1: ([LESION[0], FAR[0]], [0.7, 0.7])})
    assert list(r["thresholds"]) == [np.inf, 0.7]
    # FROC keeps all detections by default, AP only the top max_dets
    many = {1: (np.array(FAR * 150 + [LESION[0]]), np.r_[np.full(150, 0.9), 0.1])}
    assert froc({1: LESION}, many)["tp"][-1] == 1
    assert match_detections({1: LESION}, many, max_dets=100).is_tp.sum() == 0


# ---- evaluators ----------------------------------------------------------------------------------
def _toy_dataset(n=10, seed=0):
    rng = np.random.default_rng(seed)
    dicts = []
    for k in range(n):
        d = {"file_name": f"/nonexistent/{k}.dcm", "image_id": f"img{k:02d}", "height": 400,
             "width": 300, "label": int(k % 3 != 0)}
        if k % 3 != 0:
            xy = rng.uniform(0, 250, (int(rng.integers(1, 3)), 2))
            d["annotations"] = [{"bbox": [float(x), float(y), float(x + 40), float(y + 30)],
                                 "bbox_mode": BoxMode.XYXY_ABS, "category_id": 0}
                                for x, y in xy]
        elif k == 3:
            d["annotations"] = []  # full annotation, lesion-free
        dicts.append(d)
    return dicts


def _toy_outputs(dicts, seed=1):
    rng = np.random.default_rng(seed)
    outs = []
    for d in dicts:
        gt = np.array([a["bbox"] for a in d.get("annotations", [])]).reshape(-1, 4)
        nd = int(rng.integers(0, 6))
        xy = rng.uniform(0, 250, (nd, 2))
        b = np.c_[xy, xy + 35]
        if len(gt) and nd:
            b[0] = gt[0] + rng.normal(0, 4, 4)
        inst = Instances((d["height"], d["width"]))
        inst.pred_boxes = Boxes(torch.tensor(b, dtype=torch.float32).reshape(-1, 4))
        inst.scores = torch.tensor(rng.random(nd), dtype=torch.float32)
        inst.pred_classes = torch.zeros(nd, dtype=torch.int64)
        outs.append({"instances": inst})
    return outs


def _register(dicts):
    name = f"braixdet_eval_toy_{uuid.uuid4().hex[:8]}"
    DatasetCatalog.register(name, lambda: dicts)
    return name


def test_mammo_evaluator_end_to_end(tmp_path):
    dicts = _toy_dataset()
    name = _register(dicts)
    try:
        outs = _toy_outputs(dicts)
        ev = MammoDetectionEvaluator(name, output_dir=str(tmp_path))
        ev.reset()
        for k in range(0, len(dicts), 3):  # batches of 3
            ev.process([{"image_id": d["image_id"]} for d in dicts[k:k + 3]], outs[k:k + 3])
        res = ev.evaluate()
    finally:
        DatasetCatalog.remove(name)
    assert list(res["bbox"]) == ["AP20", "R@0.25", "R@0.5", "R@1", "R@2", "R@4"]

    gts = {d["image_id"]: np.array([a["bbox"] for a in d.get("annotations", [])]).reshape(-1, 4)
           for d in dicts}
    dets = {d["image_id"]: (o["instances"].pred_boxes.tensor.numpy().astype(np.float64),
                            o["instances"].scores.numpy().astype(np.float64))
            for d, o in zip(dicts, outs)}
    assert res["bbox"]["AP20"] == pytest.approx(100 * average_precision(gts, dets), abs=1e-9)
    assert res["bbox"]["R@0.5"] == pytest.approx(
        100 * froc(gts, dets)["recall_at_fppi"][0.5], abs=1e-9)
    assert 0 < res["bbox"]["AP20"] <= 100

    for f in ["metrics.json", "froc.csv", "froc.png", "detections_coco.json", "gt_coco.json"]:
        assert os.path.getsize(tmp_path / f) > 0, f
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["bbox"]["AP20"] == pytest.approx(res["bbox"]["AP20"])
    assert metrics["num_images"] == len(dicts) and metrics["units"] == "percent"
    with open(tmp_path / "froc.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["fp"]) / len(dicts) == pytest.approx(float(rows[-1]["fppi"]))
    # the COCO files reproduce the AP with pycocotools itself
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO(str(tmp_path / "gt_coco.json"))
        coco_dt = coco_gt.loadRes(str(tmp_path / "detections_coco.json"))
        e = COCOeval(coco_gt, coco_dt, "bbox")
        e.params.iouThrs = np.array([0.2])
        e.params.maxDets = [100]
        e.evaluate()
        e.accumulate()
    p = e.eval["precision"][0, :, 0, 0, 0]  # area "all"
    assert 100 * p.mean() == pytest.approx(res["bbox"]["AP20"], abs=1e-4)
    assert len(coco_gt.getImgIds()) == len(dicts)
    assert not any("/" in im["file_name"] for im in coco_gt.dataset["images"])  # no paths


def test_mammo_evaluator_partial_and_empty(tmp_path):
    dicts = _toy_dataset(6)
    name = _register(dicts)
    try:
        ev = MammoDetectionEvaluator(name, output_dir=None, distributed=False)
        assert ev.evaluate() == {}  # nothing processed: no crash
        outs = _toy_outputs(dicts[:2])
        ev.process([{"image_id": d["image_id"]} for d in dicts[:2]], outs)
        res = ev.evaluate()  # only processed images are evaluated
        assert set(res["bbox"]) >= {"AP20", "R@0.5"}
        ev.reset()
        ev.process([{"image_id": "not-in-dataset"}], outs[:1])
        with pytest.raises(KeyError):
            ev.evaluate()
    finally:
        DatasetCatalog.remove(name)


def test_build_evaluator_picks_by_meta_architecture(tmp_path):
    from detectron2.config import get_cfg

    from braixdet.config import add_braixdet_config

    cfg = add_braixdet_config(get_cfg())
    cfg.OUTPUT_DIR = str(tmp_path)
    cfg.TEST.BRAIXDET.IOU_THRESH = 0.5
    cfg.TEST.BRAIXDET.FROC_FPPI = [1.0]
    cfg.TEST.BRAIXDET.CENTER_HIT = True
    ev = build_evaluator(cfg, "some_dataset")
    assert isinstance(ev, MammoDetectionEvaluator)
    assert (ev._iou_thresh, ev._fppi, ev._center_hit) == (0.5, (1.0,), True)
    assert ev._output_dir == os.path.join(str(tmp_path), "inference", "some_dataset")
    cfg.MODEL.META_ARCHITECTURE = "MVCCLClassifier"
    assert isinstance(build_evaluator(cfg, "some_dataset"), ClassificationEvaluator)


def test_classification_evaluator_matches_sklearn(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 40)
    p = np.clip(0.3 * y + 0.7 * rng.random(40), 0.01, 0.99)
    ev = ClassificationEvaluator("toy", output_dir=str(tmp_path))
    ev.reset()
    for k in range(0, 40, 8):
        ev.process([{"image_id": f"i{j}", "label": int(y[j])} for j in range(k, k + 8)],
                   [{"prob": torch.tensor(p[j], dtype=torch.float64)} for j in range(k, k + 8)])
    res = ev.evaluate()["classification"]
    assert res["AUC"] == pytest.approx(roc_auc_score(y, p), abs=1e-9)
    assert res["BCE"] == pytest.approx(log_loss(y, p), abs=1e-9)
    assert res["ACC"] == pytest.approx(np.mean((p >= 0.5) == y))
    with open(tmp_path / "classification_predictions.csv") as f:
        assert len(list(csv.DictReader(f))) == 40

    ev.reset()
    ev.process([{"image_id": "a", "label": 1}, {"image_id": "b", "label": 1}],
               [{"prob": torch.tensor(0.2)}, {"prob": torch.tensor(0.9)}])
    with pytest.warns(RuntimeWarning, match="one class"):
        res = ev.evaluate()["classification"]
    assert np.isnan(res["AUC"]) and res["ACC"] == 0.5


# ---- tools ---------------------------------------------------------------------------------------
def test_summarize_runs_ttest(tmp_path, capsys, load_tool):
    sr = load_tool("summarize_runs")
    vals = {"BRAIxDet": ([40.0, 42.5, 45.0], [70.0, 72.0, 71.0]),
            "FasterRCNN": ([35.0, 38.0, 36.0], [65.0, 69.0, 66.0])}
    runs = []
    for method, (aps, recs) in vals.items():
        for s, (a, r) in enumerate(zip(aps, recs)):
            d = tmp_path / f"{method}_s{s}" / "inference" / "test"
            d.mkdir(parents=True)
            (d / "metrics.json").write_text(json.dumps({"bbox": {"AP20": a, "R@0.5": r}}))
            runs.append(f"{method}={tmp_path / f'{method}_s{s}'}")  # run dirs
    # a detectron2 training log (JSON lines) in a run dir is not preferred over the evaluator's
    (tmp_path / "BRAIxDet_s0" / "metrics.json").write_text(
        json.dumps({"iteration": 1, "bbox/AP20": 1.0, "bbox/R@0.5": 1.0}) + "\n")
    out = tmp_path / "summary"
    rows = sr.main(["--baseline", "FasterRCNN", "--out", str(out)]
                   + [a for r in runs for a in ("--run", r)])
    by = {r["method"]: r for r in rows}
    a, b = np.array(vals["BRAIxDet"][0]), np.array(vals["FasterRCNN"][0])
    want = stats.ttest_ind(a, b, equal_var=False, alternative="greater").pvalue
    assert by["BRAIxDet"]["AP20_p"] == pytest.approx(want)
    assert by["BRAIxDet"]["AP20_mean"] == pytest.approx(a.mean())
    assert by["BRAIxDet"]["AP20_std"] == pytest.approx(a.std(ddof=1))
    assert np.isnan(by["FasterRCNN"]["AP20_p"])
    assert (out / "summary.csv").exists() and "± " in (out / "summary.md").read_text()
    assert "BRAIxDet" in capsys.readouterr().out

    # glob + regex, and a JSON-lines log file read directly (last matching record)
    log = tmp_path / "log.json"
    log.write_text("\n".join(json.dumps({"bbox/AP20": v, "bbox/R@0.5": 1.0}) for v in (1, 7)))
    assert sr.load_metrics(str(log)) == {"AP20": 7.0, "R@0.5": 1.0}
    tagged = sr.collect_runs(glob_pattern=str(tmp_path / "*_s*" / "inference" / "*" /
                                              "metrics.json"),
                             regex=r"/(?P<method>[A-Za-z]+)_s\d+/")
    assert sorted({m for m, _ in tagged}) == ["BRAIxDet", "FasterRCNN"] and len(tagged) == 6


def test_draw_overlay_colours(tmp_path):
    img = np.full((64, 48), 0.5, dtype=np.float32)
    out = draw_overlay(img, [[5, 5, 20, 20]], [[25, 30, 40, 50]], [0.87],
                       str(tmp_path / "o.png"))
    assert out.shape == (64, 48, 3) and (tmp_path / "o.png").exists()
    assert tuple(out[5, 12]) == GT_COLOR  # top edge of the GT box
    assert tuple(out[40, 25]) == DET_COLOR  # left edge of the detection
    assert tuple(out[60, 2]) == (128, 128, 128)  # untouched grey
    small = draw_overlay(np.zeros((400, 200)), [], [], None, max_side=100)
    assert small.shape == (100, 50, 3)


def test_visualize_tool_on_dicom(tmp_path, load_tool):
    from braixdet.data.dicom import write_dicom

    px = (np.random.default_rng(0).random((96, 64)) * 4000).astype(np.uint16)
    dcm = write_dicom(tmp_path / "a.dcm", px, bits_stored=12, ImageLaterality="L",
                      ViewPosition="CC")
    preds = [{"image_id": 1, "category_id": 1, "bbox": [10, 10, 20, 20], "score": 0.9},
             {"image_id": 1, "category_id": 1, "bbox": [30, 30, 10, 10], "score": 0.1}]
    (tmp_path / "det.json").write_text(json.dumps(preds))
    vis = load_tool("visualize")
    written = vis.main(["--dicom", dcm, "--predictions", str(tmp_path / "det.json"),
                        "--out", str(tmp_path / "vis"), "--score-thresh", "0.5"])
    assert len(written) == 1 and os.path.getsize(written[0]) > 0
    import cv2

    im = cv2.imread(written[0])
    assert im.shape[:2] == (96, 64)
    assert tuple(im[10, 20]) == DET_COLOR  # kept box drawn, in original pixels
    assert tuple(im[30, 35]) != DET_COLOR  # below the score threshold: not drawn


def test_demo_overlays_draw_the_three_best_detections_of_lesion_images(tmp_path):
    """pipeline/demo.py draws through inference/visualize.py (issue 30: one drawing module):
    only images with ground truth, at most ``n``, GT in blue and the 3 best detections in red."""
    from detectron2.data import DatasetCatalog

    from braixdet.data.dicom import write_dicom
    from braixdet.pipeline.demo import draw_overlays

    px = np.full((96, 64), 2000, dtype=np.uint16)
    files = [write_dicom(tmp_path / f"{k}.dcm", px, bits_stored=12, ImageLaterality="L",
                         ViewPosition="CC") for k in "abc"]
    name = "test_demo_overlays_set"
    gt = {"bbox": [2, 2, 12, 12], "bbox_mode": 0, "category_id": 0}
    DatasetCatalog.register(name, lambda: [
        {"file_name": files[0], "image_id": "a", "annotations": [gt]},
        {"file_name": files[1], "image_id": "b", "annotations": []},
        {"file_name": files[2], "image_id": "c", "annotations": [gt]}])
    try:
        det_dir = tmp_path / "det" / "inference" / "model" / name
        det_dir.mkdir(parents=True)
        dets = [{"image_id": 1, "braixdet_image_id": "a", "category_id": 1,
                 "bbox": [20, 10 + 20 * k, 10, 10], "score": s}
                for k, s in enumerate([0.9, 0.2, 0.8, 0.7])]  # the 0.2 box is 4th best
        (det_dir / "detections_coco.json").write_text(json.dumps(dets))
        written = draw_overlays(str(tmp_path / "png"), str(tmp_path / "det"), name, n=1)
    finally:
        DatasetCatalog.remove(name)
    assert [os.path.basename(p) for p in written] == ["a.png"]
    im = cv2.imread(written[0])
    assert tuple(im[2, 7]) == GT_COLOR
    assert [tuple(im[10 + 20 * k, 25]) == DET_COLOR for k in range(4)] == [True, False, True,
                                                                           True]


def test_paired_effect_against_scipy_and_exact_cases():
    """Issue 27 item 2: effects paired by seed. The mean difference, its t interval and the
    paired t-test equal the one-sample test on the differences (scipy, another function); the
    exact Wilcoxon p of five positive differences, one-tailed, is 1/32."""
    from scipy import stats

    from braixdet.pipeline.results import paired_effect

    x, y = [70.1, 65.0, 71.4, 60.2, 66.6], [66.0, 64.1, 69.0, 61.0, 62.5]
    d = np.subtract(x, y)
    e = paired_effect(x, y)
    half = stats.t.ppf(0.975, 4) * np.std(d, ddof=1) / np.sqrt(5)
    assert e["n"] == 5 and e["mean"] == pytest.approx(d.mean())
    assert (e["ci_low"], e["ci_high"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert e["p_t"] == pytest.approx(stats.ttest_1samp(d, 0.0).pvalue)
    up = paired_effect([1, 2, 3, 4, 5], [0, 0, 0, 0, 0], alternative="greater")
    assert up["p_wilcoxon"] == pytest.approx(1 / 32)
    assert np.isnan(paired_effect([1.0], [0.0])["ci_low"])  # one seed: no interval, no test
    assert np.isnan(paired_effect([1.0, 2.0], [1.0, 2.0])["p_wilcoxon"])  # no difference
    assert e["sd"] == pytest.approx(np.std(d, ddof=1))
    # a seed undefined on either side (NaN; None as nan_to_none wrote it) is left out
    gap = paired_effect(x + [np.nan, 61.0], y + [60.0, None])
    assert gap["n"] == 5 and gap["p_t"] == pytest.approx(e["p_t"]) and gap["mean"] == e["mean"]


def test_seeds_to_detect_matches_the_noncentral_t_power():
    """seeds_to_detect: the smallest n whose two-sided paired t-test at alpha 0.05 has power
    >= 0.8, checked against the power from scipy's noncentral t (another implementation): at
    n the power reaches 0.8, at n - 1 it does not. Halving the spread needs about a quarter."""
    from scipy import stats

    from braixdet.pipeline.results import seeds_to_detect

    def power(n, effect, sd, alpha=0.05):
        t = stats.t.ppf(1 - alpha / 2, n - 1)
        nc = effect / sd * np.sqrt(n)
        return stats.nct.sf(t, n - 1, nc) + stats.nct.cdf(-t, n - 1, nc)

    n = seeds_to_detect(2.3, 4.3)
    assert power(n, 2.3, 4.3) >= 0.8 > power(n - 1, 2.3, 4.3)
    assert n == 30  # the paper's CAM fusion at §16's spread of BRAIxDet − Mean Teacher
    assert seeds_to_detect(-2.3, 4.3) == n  # the sign does not matter, two-sided
    assert seeds_to_detect(2.3, 2.15) < n / 3
    assert np.isnan(seeds_to_detect(2.3, float("nan"))) and np.isnan(seeds_to_detect(2.3, 0.0))


def test_paired_tables_put_each_component_beside_the_papers_sign():
    """Table 6's components from the rows of each seed: MV as Faster R-CNN + MV − Faster R-CNN
    (paper +5.5), only over seeds holding both rows; the ceiling is never compared with."""
    from braixdet.pipeline.results import CEILING, OURS, paired_tables, seeds_to_detect

    def seed(frcnn, mv, ours):
        return {"results": {"Faster R-CNN": {"bbox": {"AP20": frcnn}},
                            "Faster R-CNN + MV": {"bbox": {"AP20": mv}},
                            OURS: {"bbox": {"AP20": ours}}, CEILING: {"bbox": {"AP20": 99.0}}}}

    md, out = paired_tables([seed(60.0, 55.0, 70.0), seed(62.0, 58.0, 71.0),
                             seed(58.0, 55.0, 69.0)])
    mv = out["components"]["MV"]
    assert mv["n"] == 3 and mv["mean"] == pytest.approx(-4.0)
    assert mv["paper"] == pytest.approx(90.05 - 84.52)
    assert "| MV | Faster R-CNN + MV − Faster R-CNN | 3 | -4.0 [" in md and "| +5.5 | no |" in md
    # MV's differences -5, -4, -3 (sd 1): the paper's +5.5 needs few seeds at that spread
    assert mv["seeds_to_detect_paper"] == seeds_to_detect(90.05 - 84.52, 1.0) < 5
    assert out["components"]["CAM fusion"]["n"] == 0  # no Mean Teacher row: not paired
    assert set(out["ours_vs"]) == {"Faster R-CNN", "Faster R-CNN + MV"}
    assert out["ours_vs"]["Faster R-CNN"]["mean"] == pytest.approx(10.0)


def test_paper_table_cells_over_seeds_and_missing_values():
    """The paper-style table: mean ± std over seeds (ddof 1), the value alone for one seed, and
    "n/a" where a stage-1 AUC or an exam AUC is missing (a one-class split), never "nan"."""
    from braixdet.pipeline.results import paper_table

    def seed(ap, val_auc, exam_auc):
        return {"protocol": {"seed": int(ap)},
                "results": {"Faster R-CNN": {"bbox": {"AP20": ap, "R@0.5": 60.0},
                                             "exam_AUC": exam_auc}},
                "classifiers": {"mvccl": {"val": {"AUC": val_auc}, "test": {"AUC": None}}}}

    md, _ = paper_table([seed(50.0, 0.70, 0.8), seed(54.0, 0.74, None)])
    assert "| Faster R-CNN | 2 | 52.0 ± 2.8 | 60.0 ± 0.0 | 0.8 | n/a |" in md, md
    assert "| mvccl | 0.720 ± 0.028 | n/a | 2 |" in md, md
    assert "nan" not in md
