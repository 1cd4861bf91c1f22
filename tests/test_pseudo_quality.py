"""Algorithm 2's box sources (gradcam / oracle / random) and the pseudo-label quality scalars."""
import json
import os
import sys
import types

import numpy as np
import pytest
import torch
from _train_helpers import CONFIGS, tiny_opts

from braixdet.ssl.box_sources import (
    breast_region,
    place_random_boxes,
    random_box_lookup,
    true_box_lookup,
)
from braixdet.ssl.pseudo_quality import (
    QualityWindow,
    match_counts,
    plot_quality_curves,
    read_quality_curves,
)

T1, T2 = [0, 0, 10, 10], [20, 20, 30, 30]


def test_match_counts_three_boxes_two_truths():
    # IoU with T1 = 1; with T2 = 20/100 = 0.2 (a hit: IoU >= 0.2 like the evaluation); 10/100
    assert match_counts([T1, [20, 20, 30, 22], [20, 20, 30, 21]], [T1, T2]) == (2, 3, 2, 2)
    # IoU with T1 = 50/100 and 0 with T2, so T2 is missed: precision 2/3, recall 1/2
    assert match_counts([T1, [0, 0, 10, 5], [20, 20, 30, 21]], [T1, T2]) == (2, 3, 1, 2)
    assert match_counts(torch.zeros(0, 4), [T1]) == (0, 0, 0, 1)
    assert match_counts([T1], torch.zeros(0, 4)) == (0, 1, 0, 0)


def test_quality_window_pools_the_last_iterations():
    q = QualityWindow(window=2)
    q.add({"teacher": [[T1, [20, 20, 30, 21]]], "fused": [[T1]]}, [[T1, T2]])
    assert q.scalars() == {"ssl/quality/teacher_precision": 0.5,
                           "ssl/quality/teacher_recall": 0.5,
                           "ssl/quality/fused_precision": 1.0,
                           "ssl/quality/fused_recall": 0.5}
    q.add({"teacher": [torch.zeros(0, 4)], "fused": [[T2]]}, [[T2]])
    s = q.scalars()  # teacher: 1 of 2 boxes, 1 of 3 lesions; fused: 2 of 2, 2 of 3
    assert (s["ssl/quality/teacher_precision"], s["ssl/quality/teacher_recall"]) == (0.5, 1 / 3)
    assert (s["ssl/quality/fused_precision"], s["ssl/quality/fused_recall"]) == (1.0, 2 / 3)
    q.add({"teacher": [torch.zeros(0, 4)], "fused": [torch.zeros(0, 4)]}, [[T1]])
    s = q.scalars()  # the first iteration left the window: the teacher has no box in it
    assert "ssl/quality/teacher_precision" not in s and "ssl/quality/cam_recall" not in s
    assert s["ssl/quality/teacher_recall"] == 0.0 and s["ssl/quality/fused_recall"] == 0.5


def test_quality_curves_from_metrics_json_and_plot(tmp_path, monkeypatch):
    path = tmp_path / "metrics.json"
    recs = [{"iteration": 19, "ssl/quality/teacher_precision": 0.25, "loss": 1.0},
            {"iteration": 39, "ssl/quality/teacher_precision": 0.5,
             "ssl/quality/cam_recall": 0.75},
            {"iteration": 40, "bbox/AP20": 50.0}]
    path.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"iteration": 5')  # torn line
    curves = read_quality_curves(path)
    assert curves == {"teacher": {"precision": [(19, 0.25), (39, 0.5)], "recall": []},
                      "cam": {"precision": [], "recall": [(39, 0.75)]}}
    png = plot_quality_curves(curves, str(tmp_path / "q.png"))
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    # the thin CLI: the same plot from the file
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                             "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["plot_pseudo_quality.py", str(path), "--out",
                                      str(tmp_path / "cli.png")])
    __import__("plot_pseudo_quality").main()
    assert (tmp_path / "cli.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_place_random_boxes_inside_the_region():
    region = np.zeros((40, 30), bool)
    region[5:15, 10:20] = True  # a 10 x 10 "breast"
    boxes = place_random_boxes(region, [(4, 3), (20, 20)], np.random.default_rng(0))
    # the 20 x 20 box shrinks by 0.8 until it fits: 20 * 0.8**3 = 10.24 -> 10 x 10, the region
    assert [b[2] - b[0] for b in boxes] == [4, 10] and [b[3] - b[1] for b in boxes] == [3, 10]
    assert list(boxes[1]) == [10, 5, 20, 15]
    for x0, y0, x1, y1 in boxes.astype(int):
        assert region[y0:y1, x0:x1].all()
    assert len(place_random_boxes(np.zeros((5, 5), bool), [(2, 2)], np.random.default_rng(0))) \
        == 0


@pytest.fixture(scope="module")
def weak(tmp_path_factory, synthetic_root):
    """D_w of the demo protocol on the session's synthetic dataset, its canonical cache, and the
    generator's truth (malignant boxes per mammogram, by absolute path)."""
    from detectron2.data import DatasetCatalog

    from braixdet.config import build_cfg, resolve_cfg
    from braixdet.data.cache import CanonicalCache
    from braixdet.data.preprocess import PreprocessParams

    d = tmp_path_factory.mktemp("box_sources")
    cfg = build_cfg(CONFIGS["braixdet"], tiny_opts(synthetic_root.root, d / "out", d / "cache"))
    cfg = resolve_cfg(cfg)
    dicts = DatasetCatalog.get(cfg.DATASETS.TRAIN_WEAK[0])
    truth = {os.path.join(synthetic_root.root, t["path"]):
             [les["bbox"] for les in t["lesions"] if les["malignant"]]
             for t in synthetic_root.summary["truth"]}
    cache = CanonicalCache(str(d / "cache"), PreprocessParams((128, 64)))
    return types.SimpleNamespace(dicts=dicts, truth=truth, cache=cache)


def test_oracle_source_is_exactly_the_weak_cancers_true_boxes(weak):
    lookup = true_box_lookup(weak.dicts)
    cancers = [d for d in weak.dicts if d["label"] == 1]
    assert cancers and sorted(lookup) == sorted(str(d["image_id"]) for d in cancers)
    for d in cancers:
        assert lookup[str(d["image_id"])]["boxes"] == weak.truth[d["file_name"]]
    assert all("annotations" not in d for d in weak.dicts)  # D_w trains on labels only


def test_random_source_inside_the_breast_and_reproducible(weak):
    a = random_box_lookup(weak.dicts, weak.cache, seed=5)
    assert a == random_box_lookup(weak.dicts, weak.cache, seed=5)
    assert a != random_box_lookup(weak.dicts, weak.cache, seed=6)
    truth = true_box_lookup(weak.dicts)
    counts = {len(v["boxes"]) for v in truth.values()}
    assert sorted(a) == sorted(truth)  # every weak cancer gets boxes
    for d in weak.dicts:
        if d["label"] != 1:
            continue
        boxes = np.asarray(a[str(d["image_id"])]["boxes"]).reshape(-1, 4)
        assert len(boxes) in counts
        img, tfm = weak.cache.get(d["file_name"], d["laterality"])
        region = breast_region(img)
        for x0, y0, x1, y1 in np.round(tfm.apply_box(boxes)).astype(int):
            assert x1 > x0 and y1 > y0 and region[y0:y1, x0:x1].all()
        # not the truth: no random box coincides with a true box
        iou = match_counts(boxes, weak.truth[d["file_name"]], iou_thresh=0.99)
        assert iou[0] == 0


def test_oracle_rows_and_refused_settings(weak):
    """The pipeline rows set the source on the paper's BRAIxDet config; settings that would do
    nothing with a non-GradCAM source are refused with one line."""
    from braixdet.config import build_cfg
    from braixdet.pipeline.methods import METHODS
    from braixdet.ssl.box_sources import source_lookup

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for key, source in (("braixdet_oracle_boxes", "oracle"), ("braixdet_random_boxes", "random")):
        m = METHODS[key]
        cfg = build_cfg(os.path.join(repo, "configs", m.config), list(m.opts))
        assert (cfg.SSL.CAM_BOX_SOURCE, cfg.SSL.CAM_JSON, m.cam) == (source, "", False)
        if source == "oracle":
            assert source_lookup(cfg, [], lambda: None, 0) == {}  # no weak cancer, no box
        else:  # nothing to draw the count and sizes from
            with pytest.raises(ValueError, match="known boxes"):
                source_lookup(cfg, [], lambda: None, 0)
    base = os.path.join(repo, "configs", "demo", "BRAIxDet", "braixdet.yaml")
    # an unknown source is refused when the config is built (config/checks.py)
    for opts, msg in ((["SSL.CAM_BOX_SOURCE", "truth"], "allowed: one of 'gradcam'"),
                      (["SSL.CAM_BOX_SOURCE", "oracle", "SSL.CAM_JSON", "x.json"], "GradCAM"),
                      (["SSL.CAM_BOX_SOURCE", "oracle", "SSL.USE_CAM", "False"], "USE_CAM")):
        with pytest.raises(ValueError, match=msg):
            source_lookup(build_cfg(base, opts), weak.dicts, None, 0)
