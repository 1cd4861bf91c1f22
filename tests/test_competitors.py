"""SSL competitors (issue 22): thresholded pseudo-labels, strong augmentation of the student's
copy, per-term loss masks, the ROI focal loss, and a few iterations of Unbiased Teacher."""
import os

import pytest
import torch
from detectron2.structures import Boxes, Instances

from braixdet.modeling.rcnn import softmax_focal_loss
from braixdet.ssl.competitors import (
    StrongAugment,
    keep_loss_terms,
    strong_augment,
    threshold_pseudo_targets,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _teacher(boxes, scores, size=(64, 32)):
    inst = Instances(size)
    inst.pred_boxes = Boxes(torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4))
    inst.scores = torch.tensor(scores, dtype=torch.float32)
    inst.pred_classes = torch.zeros(len(scores), dtype=torch.long)
    return inst


def test_threshold_keeps_every_box_at_or_above_the_threshold():
    out = _teacher([[1, 1, 5, 5], [2, 2, 9, 9], [0, 0, 3, 3], [4, 4, 4, 8]],
                   [0.95, 0.7, 0.69, 0.99])  # the last one is empty: dropped
    (t,) = threshold_pseudo_targets([out], [{"image": torch.zeros(1, 64, 32)}], 0.7)
    assert t.gt_boxes.tensor.tolist() == [[1, 1, 5, 5], [2, 2, 9, 9]]
    assert torch.allclose(t.gt_scores, torch.tensor([0.95, 0.7]))
    (none,) = threshold_pseudo_targets([out], [{"image": torch.zeros(1, 64, 32)}], 0.999)
    assert len(none) == 0 and none.image_size == (64, 32)  # an all-background image


def test_softmax_focal_loss_matches_a_hand_computation():
    logits = torch.tensor([[2.0, 0.0], [0.5, 1.5], [0.0, 0.0]])
    target = torch.tensor([0, 0, 1])
    p = torch.softmax(logits, 1)[torch.arange(3), target]
    hand = sum(-((1 - float(q)) ** 1.5) * torch.log(q) for q in p) / 3
    assert float(softmax_focal_loss(logits, target, 1.5)) == pytest.approx(float(hand), rel=1e-6)
    ce = torch.nn.functional.cross_entropy(logits, target)
    assert float(softmax_focal_loss(logits, target, 0.0)) == pytest.approx(float(ce), rel=1e-6)


def test_strong_augment_changes_the_students_copy_only_and_moves_its_boxes():
    torch.manual_seed(0)
    image = torch.zeros(1, 64, 32)
    image[:, 20:30, 8:16] = 1.0  # a bright lesion exactly inside the box
    inst = Instances((64, 32))
    inst.gt_boxes = Boxes(torch.tensor([[8.0, 20.0, 16.0, 30.0]]))
    inst.gt_classes = torch.zeros(1, dtype=torch.long)
    weak = {"image": image, "instances": inst, "image_id": "a"}
    before = image.clone()
    aug = StrongAugment(color=0.0, translate=0.2, scale=(1.0, 1.0), cutout_p=0.0)
    student = strong_augment(weak, aug)
    assert torch.equal(weak["image"], before) and weak["instances"] is inst  # teacher's copy
    assert student["image_id"] == "a" and not torch.equal(student["image"], before)
    ys, xs = torch.nonzero(student["image"][0] > 0.5, as_tuple=True)
    x0, y0, x1, y1 = student["instances"].gt_boxes.tensor[0].tolist()
    assert (x0, y0) == pytest.approx((float(xs.min()), float(ys.min())), abs=1.0)
    assert (x1, y1) == pytest.approx((float(xs.max()) + 1, float(ys.max()) + 1), abs=1.0)


def test_unbiased_teacher_trains_no_box_regression_on_pseudo_labels():
    from braixdet.config import build_cfg

    cfg = build_cfg(os.path.join(REPO, "configs", "baselines", "unbiased_teacher.yaml"), [])
    losses = {k: torch.tensor(1.0) for k in
              ("loss_rpn_cls", "loss_rpn_loc", "loss_cls", "loss_box_reg")}
    kept = keep_loss_terms(losses, cfg.SSL.UNSUP_LOSSES)
    assert sorted(kept) == ["loss_cls", "loss_rpn_cls"]
    assert keep_loss_terms(losses, []) == losses
    with pytest.raises(KeyError, match="loss_clss"):
        keep_loss_terms(losses, ["loss_clss"])


def _competitor_trainer(name, synthetic_root, tmp_path, monkeypatch, max_iter, extra):
    """A tiny trainer of one competitor's demo config (one torch thread)."""
    import _train_helpers as th

    monkeypatch.setitem(th.CONFIGS, name, os.path.join(
        REPO, "configs", "demo", "baselines", f"{name}.yaml"))
    torch.set_num_threads(1)
    opts = th.tiny_opts(synthetic_root.root, tmp_path / name, tmp_path / "cache", stage=name,
                        max_iter=max_iter, extra=[*extra, "TEST.BRAIXDET.EVAL_STUDENT", "False"])
    return th.build_trainer(name, opts)


def test_unbiased_teacher_few_iterations(synthetic_root, tmp_path, monkeypatch):
    """Burn-in (teacher = student), then weak losses with classification terms only; each
    labelled image trains as its weak copy and a strong copy (the labelled batch doubles)."""
    t = _competitor_trainer("unbiased_teacher", synthetic_root, tmp_path, monkeypatch, 3,
                            ["SSL.BURN_IN_ITERS", "1", "SSL.TEACHER_SCORE_THRESH", "0.0"])
    assert type(t.model.roi_heads).__name__ == "FocalLossROIHeads"
    assert t.cfg.MODEL.RPN.POSITIVE_FRACTION == 0.25
    sizes, forward = [], t.model.forward
    monkeypatch.setattr(t.model, "forward", lambda b: (sizes.append(len(b)), forward(b))[1])
    seen = []
    step = t._trainer
    optimize = step.optimize
    monkeypatch.setattr(step, "optimize", lambda d, dt: (seen.append(sorted(d)), optimize(d, dt)))
    t.train()
    assert seen[0] == ["loss_box_reg", "loss_cls", "loss_rpn_cls", "loss_rpn_loc"]  # burn-in
    weak = {k for keys in seen[1:] for k in keys if k.startswith("weak_")}
    assert weak == {"weak_loss_cls", "weak_loss_rpn_cls"}
    assert sizes[0] == 2 * t.cfg.SOLVER.IMS_PER_BATCH
    assert os.path.exists(tmp_path / "unbiased_teacher" / "model_export.pth")


def test_background_weighting_is_the_official_joint_mean_on_three_rois():
    """microsoft/SoftTeacher: Σ w ℓ / max(Σ w, 1), w = 1 on the foreground ROI and the teacher's
    background score on the two background ROIs; hand-computed cross-entropies."""
    import math

    from braixdet.ssl.soft_teacher import background_weighted_cls_loss

    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [math.log(3.0), 0.0]])
    gt = torch.tensor([0, 1, 1])  # class 1 is background: ROI 0 foreground, ROIs 1-2 background
    bg = torch.tensor([0.5, 0.8, 0.2])  # the teacher's background scores
    # ℓ = -log p: ROI 0 log 2, ROI 1 -log(3/4), ROI 2 -log(1/4); weights 1, 0.8, 0.2 (sum 2)
    hand = (math.log(2) + 0.8 * math.log(4 / 3) + 0.2 * math.log(4)) / 2.0
    assert float(background_weighted_cls_loss(logits, gt, bg)) == pytest.approx(hand, rel=1e-6)
    # weights summing below one are not scaled up: the denominator is max(Σ w, 1)
    low = torch.tensor([0.5, 0.1, 0.2])
    hand_low = 0.1 * math.log(4 / 3) + 0.2 * math.log(4)
    assert float(background_weighted_cls_loss(logits[1:], gt[1:], low[1:])) == pytest.approx(
        hand_low, rel=1e-6)


def test_jitter_uncertainty_selects_the_stable_boxes():
    """Std over jitters over the MEAN refined box's width/height (the official normalisation)."""
    from braixdet.ssl.soft_teacher import box_uncertainty

    box = torch.tensor([0.0, 0.0, 10.0, 20.0])
    stable = box.expand(4, 4).clone()
    stable[:, 0] += torch.tensor([0.0, 0.1, 0.0, -0.1])  # x0 std = 0.0816, mean width 10
    shaky = box.expand(4, 4).clone()
    shaky[:, 3] += torch.tensor([0.0, 4.0, 0.0, -4.0])  # y1 std = 3.266, mean height 20
    refined = torch.stack([stable, shaky], dim=1)  # (times, n, 4)
    unc = box_uncertainty(refined)
    s = torch.tensor([0.0, 0.1, 0.0, -0.1]).std()
    assert unc.tolist() == pytest.approx([float(s / 10 / 4), float(40 * s / 20 / 4)], rel=1e-5)
    assert (unc < 0.02).tolist() == [True, False]


def test_ema_momentum_ramp_is_soft_teachers():
    """min(0.999, 1 - 1/(s+1)) at the official hook's step s = our iteration + 1."""
    from braixdet.ssl.ema import ema_momentum

    assert [ema_momentum(0.999, t, ramp=True) for t in (0, 1, 18, 997, 998, 5000)] == \
        pytest.approx([0.5, 2 / 3, 0.95, 1 - 1 / 999, 0.999, 0.999], abs=1e-9)
    assert ema_momentum(0.999, 3, ramp=False) == 0.999


def test_stac_keeps_the_top_box_of_an_image_without_a_confident_one():
    """STAC labels with min(0.9, best score): one 0.4 box is kept; with a 0.95 box only the
    boxes >= 0.9 are; an image without any teacher box stays all background."""
    inp = [{"image": torch.zeros(1, 64, 32)}]
    (t,) = threshold_pseudo_targets([_teacher([[1, 1, 5, 5]], [0.4])], inp, 0.9, keep_top=True)
    assert t.gt_boxes.tensor.tolist() == [[1, 1, 5, 5]]
    (none,) = threshold_pseudo_targets([_teacher([[1, 1, 5, 5]], [0.4])], inp, 0.9)
    assert len(none) == 0  # without keep_top (Unbiased/Soft Teacher): all background
    two = _teacher([[1, 1, 5, 5], [2, 2, 9, 9], [0, 0, 3, 3]], [0.95, 0.9, 0.89])
    (t,) = threshold_pseudo_targets([two], inp, 0.9, keep_top=True)
    assert t.gt_boxes.tensor.tolist() == [[1, 1, 5, 5], [2, 2, 9, 9]]
    (e,) = threshold_pseudo_targets([_teacher([], [])], inp, 0.9, keep_top=True)
    assert len(e) == 0


def test_stac_augment_colour_geometry_and_cutout():
    """Each STAC step on a hand-checkable image: solarize at level 5 inverts pixels >= 0.5; a
    global translation moves the box by the image shift; the in-box affine leaves the boxes and
    the outside untouched; the cut-outs paint 128/255 only."""
    from braixdet.ssl.competitors import StacAugment

    aug = StacAugment()
    img = torch.tensor([[[0.2, 0.6], [0.5, 0.9]]])
    assert torch.allclose(aug.color(img, "solarize", 5), torch.tensor([[[0.2, 0.4], [0.5, 0.1]]]))
    assert torch.equal(aug.color(img, "color", 7), img)  # saturation: one channel, identity
    torch.manual_seed(0)
    image = torch.zeros(1, 64, 32)
    image[:, 20:30, 8:16] = 1.0
    boxes = torch.tensor([[8.0, 20.0, 16.0, 30.0]])
    moved = 0
    for _ in range(30):
        out, b = aug.geometric(image, boxes)
        if torch.equal(b, boxes):  # in-box affine (or a zero move): outside unchanged
            outside = torch.ones_like(image, dtype=torch.bool)
            outside[:, 20:30, 8:16] = False
            assert torch.equal(out[outside], image[outside])
        else:
            moved += 1
            ys, xs = torch.nonzero(out[0] > 0.99, as_tuple=True)
            if len(ys) == 80 and b[0, 2] - b[0, 0] == 8:  # a pure translation
                assert [float(xs.min()), float(ys.min())] == pytest.approx(b[0, :2].tolist())
    assert moved > 0
    cut = aug.cutout(torch.zeros(1, 64, 32))
    assert torch.isclose(cut[cut > 0], torch.tensor(128 / 255)).all() and (cut > 0).any()


def test_unbiased_teacher_augment_is_photometric():
    """UT's strong copy keeps its boxes exactly (no geometry)."""
    from braixdet.ssl.competitors import UnbiasedTeacherAugment

    torch.manual_seed(1)
    inst = Instances((64, 32))
    inst.gt_boxes = Boxes(torch.tensor([[8.0, 20.0, 16.0, 30.0]]))
    inst.gt_classes = torch.zeros(1, dtype=torch.long)
    ex = {"image": torch.rand(1, 64, 32), "instances": inst}
    out = strong_augment(ex, UnbiasedTeacherAugment())
    assert out["instances"].gt_boxes.tensor.tolist() == [[8.0, 20.0, 16.0, 30.0]]


def test_soft_teacher_few_iterations(synthetic_root, tmp_path, monkeypatch):
    """End to end from the first iteration (the demo's burn-in off): every loss term on the
    pseudo-labelled images, the classification one through the background-weighted loss from
    the boxes >= SOFT_TEACHER_CLS_THRESH, regression from the reliable boxes through a second
    sampling of the proposals."""
    from braixdet.ssl import soft_teacher

    t = _competitor_trainer("soft_teacher", synthetic_root, tmp_path, monkeypatch, 1,
                            ["SSL.TEACHER_SCORE_THRESH", "0.0", "SSL.JITTER_TIMES", "3",
                             "SSL.BURN_IN_ITERS", "0", "SSL.SOFT_TEACHER_CLS_THRESH", "0.3"])
    rh, sampled = t.model.roi_heads, []
    sample = rh.label_and_sample_proposals
    monkeypatch.setattr(rh, "label_and_sample_proposals", lambda p, g: (
        sampled.append([x for x in g if x.has("gt_scores")]), sample(p, g))[1])
    calls, seen = [], []
    weighted = soft_teacher.background_weighted_cls_loss
    monkeypatch.setattr(soft_teacher, "background_weighted_cls_loss",
                        lambda *a: (calls.append(1), weighted(*a))[1])
    step = t._trainer
    optimize = step.optimize
    monkeypatch.setattr(step, "optimize", lambda d, dt: (seen.append(sorted(d)), optimize(d, dt)))
    t.train()
    assert {k for keys in seen for k in keys if k.startswith("weak_")} == {
        "weak_loss_cls", "weak_loss_box_reg", "weak_loss_rpn_cls", "weak_loss_rpn_loc"}
    assert calls
    pseudo = [g for g in sampled if g]  # the two samplings of the pseudo-labelled batch
    assert len(pseudo) == 2
    cls_set, reg_set = pseudo
    assert all(bool((g.gt_scores >= 0.3).all()) for g in cls_set)
    assert all(bool(g.gt_reg_ok.all()) for g in reg_set)
    assert os.path.exists(tmp_path / "soft_teacher" / "model_export.pth")


def test_stac_labels_with_the_fixed_supervised_detector(synthetic_root, tmp_path, monkeypatch):
    """STAC: the teacher is the supervised detector's export and never moves (EMA_ALPHA 1.0),
    so the pseudo-labels of D_w are those of that detector; the student trains on them."""
    import _train_helpers as th

    from braixdet.utils.checkpoint import safe_torch_load

    monkeypatch.setitem(th.CONFIGS, "stac", os.path.join(
        REPO, "configs", "demo", "baselines", "stac.yaml"))
    torch.set_num_threads(1)
    sup = th.tiny_opts(synthetic_root.root, tmp_path / "sup", tmp_path / "cache",
                       stage="faster_rcnn", max_iter=1)
    th.build_trainer("faster_rcnn", sup).train()
    export = tmp_path / "sup" / "model_export.pth"
    opts = th.tiny_opts(synthetic_root.root, tmp_path / "stac", tmp_path / "cache",
                        stage="stac", max_iter=1, extra=[
                            "SSL.TEACHER_WEIGHTS", str(export), "SSL.TEACHER_SCORE_THRESH", "0.0",
                            "TEST.BRAIXDET.EVAL_STUDENT", "False"])
    t = th.build_trainer("stac", opts)
    seen = []
    step = t._trainer
    optimize = step.optimize
    monkeypatch.setattr(step, "optimize", lambda d, dt: (seen.append(sorted(d)), optimize(d, dt)))
    t.train()
    assert any(k.startswith("weak_") for keys in seen for k in keys)
    fixed = safe_torch_load(str(export))["model"]
    teacher = t.teacher.state_dict()
    assert all(torch.equal(teacher[k], v) for k, v in fixed.items())
    # STAC's model is the student trained on those labels: it is the one exported
    exported = safe_torch_load(str(tmp_path / "stac" / "model_export.pth"))["model"]
    student = t.model.state_dict()
    assert all(torch.equal(student[k], v) for k, v in exported.items())
    assert not all(torch.equal(fixed[k], v) for k, v in exported.items() if k in fixed)


def test_jitter_selection_without_pseudo_boxes_asks_nothing():
    """No teacher box above the threshold: every image's flags are empty (no teacher call)."""
    from braixdet.ssl.soft_teacher import reliable_for_regression

    empty = Instances((64, 32))
    empty.gt_boxes = Boxes(torch.zeros(0, 4))
    empty.gt_classes = torch.zeros(0, dtype=torch.long)
    flags = reliable_for_regression(None, [{}, {}], [empty, empty], 10, 0.06, 0.02)
    assert [f.tolist() for f in flags] == [[], []]
