"""Soft Teacher's two mechanisms (Xu et al. 2021, §3.2-3.3), on our Faster R-CNN, as the
official code (microsoft/SoftTeacher ssod/models/soft_teacher.py) computes them.

* Pseudo-box sets: the teacher's boxes above 0.5 (``pseudo_label_initial_score_thr``) are the
  candidates; those >= 0.9 train the RPN and the classifier, those whose jitter uncertainty is
  < 0.02 (any score above 0.5) train box regression, through their OWN proposal sampling.
* Background weighting: the classification loss is ONE weighted mean over the sampled
  proposals, Σ w_j ℓ_j / max(Σ w_j, 1), with w = 1 on foreground proposals and w = the
  teacher's background score on background ones (the paper's formula normalises the two parts
  separately; the official code, which we follow, does not).
* Box jittering: the teacher refines ``times`` jittered copies of a pseudo-box; its uncertainty
  is the mean over the 4 coordinates of their std, over the mean refined box's width/height.
Our choice: the teacher scores the student's proposals on the student's own (strongly
augmented) image, which needs no inverse geometry.
"""
import torch
import torch.nn.functional as F
from detectron2.structures import Boxes, Instances

from .ema import unwrap

__all__ = ["background_weighted_cls_loss", "box_uncertainty", "teacher_box_outputs",
           "soft_teacher_losses"]


def background_weighted_cls_loss(logits, gt_classes, bg_scores):
    """Soft Teacher's classification loss (background = the last class index): Σ w ℓ /
    max(Σ w, 1), w = 1 on foreground proposals, the teacher's background score on the others."""
    bg_class = logits.shape[1] - 1
    ce = F.cross_entropy(logits.float(), gt_classes, reduction="none")
    w = torch.where(gt_classes == bg_class, bg_scores.float().detach(), torch.ones_like(ce))
    return (w * ce).sum() / w.sum().clamp(min=1.0)


@torch.no_grad()
def teacher_box_outputs(teacher, batch, boxes_per_image):
    """The teacher's class probabilities and class-specific refined boxes for given boxes
    (list of (n_i, 4) tensors in the images' input frame): (probs (N, K+1), boxes (N, K, 4))."""
    t = unwrap(teacher)
    images = t.preprocess_image(batch)
    features = t.backbone(images.tensor)
    rh = t.roi_heads
    proposals = []
    for b, size in zip(boxes_per_image, images.image_sizes):
        p = Instances(size)
        p.proposal_boxes = Boxes(b.to(t.device).float())
        proposals.append(p)
    feats = [features[f] for f in rh.box_in_features]
    box_features = rh.box_head(rh.box_pooler(feats, [p.proposal_boxes for p in proposals]))
    predictions = rh.box_predictor(box_features)
    probs = torch.cat(rh.box_predictor.predict_probs(predictions, proposals))
    refined = torch.cat(rh.box_predictor.predict_boxes(predictions, proposals))
    return probs, refined.reshape(len(probs), -1, 4)


def box_uncertainty(refined_jitters):
    """Mean over the 4 coordinates of the std over jitters, each over the width (x) or height
    (y) of the mean refined box: ``refined_jitters`` (times, n, 4)."""
    mean = refined_jitters.mean(dim=0)
    wh = (mean[:, 2:] - mean[:, :2]).clamp(min=1.0)
    std = refined_jitters.std(dim=0)  # (n, 4)
    return (std / wh.repeat(1, 2)).mean(dim=1)


def jitter(boxes, times, scale):
    """``times`` copies of ``boxes`` (n, 4) with each coordinate moved by N(0, scale × side)."""
    wh = (boxes[:, 2:] - boxes[:, :2]).clamp(min=1.0).repeat(1, 2)
    return boxes[None] + torch.randn(times, *boxes.shape, device=boxes.device) * wh * scale


def reliable_for_regression(teacher, batch, targets, times, scale, thresh):
    """Per image, a bool per pseudo-box: its jitter uncertainty < ``thresh``."""
    if sum(len(t) for t in targets) == 0:  # no pseudo-box (e.g. none >= 0.9): nothing to ask
        return [torch.zeros(0, dtype=torch.bool, device=t.gt_boxes.device) for t in targets]
    jittered = [jitter(t.gt_boxes.tensor, times, scale).reshape(-1, 4) for t in targets]
    _, refined = teacher_box_outputs(teacher, batch, jittered)
    out, start = [], 0
    for t in targets:
        n = len(t)
        r = refined[start:start + n * times]
        start += n * times
        cls = t.gt_classes.repeat(times)
        r = r[torch.arange(len(r), device=r.device), cls].reshape(times, n, 4)
        out.append(box_uncertainty(r) < thresh if n else
                   torch.zeros(0, dtype=torch.bool, device=r.device))
    return out


def _roi_forward(rh, features, proposals):
    feats = [features[f] for f in rh.box_in_features]
    boxes = [p.proposal_boxes for p in proposals]
    return boxes, rh.box_predictor(rh.box_head(rh.box_pooler(feats, boxes)))


def soft_teacher_losses(student, teacher, batch, cls_thresh=0.9):
    """The student's losses on pseudo-labelled ``batch`` (instances carry the teacher's
    ``gt_scores`` and ``gt_reg_ok``): RPN and background-weighted classification from the boxes
    >= ``cls_thresh``, box regression from the reliable boxes with their own ROI sampling."""
    s = unwrap(student)
    images = s.preprocess_image(batch)
    gt = [x["instances"].to(s.device) for x in batch]
    gt_cls = [g[g.gt_scores >= cls_thresh] if g.has("gt_scores") else g for g in gt]
    gt_reg = [g[g.gt_reg_ok] if g.has("gt_reg_ok") else g[:0] for g in gt]
    features = s.backbone(images.tensor)
    proposals, losses = s.proposal_generator(images, features, gt_cls)
    rh = s.roi_heads
    cls_props = rh.label_and_sample_proposals(proposals, gt_cls)
    boxes, (scores, _) = _roi_forward(rh, features, cls_props)
    gt_classes = torch.cat([p.gt_classes for p in cls_props])
    bg_class = scores.shape[1] - 1
    probs, _ = teacher_box_outputs(teacher, batch, [b.tensor.detach() for b in boxes])
    losses["loss_cls"] = background_weighted_cls_loss(scores, gt_classes, probs[:, bg_class])
    # regression: a second sampling of the same proposals against the reliable boxes
    reg_props = rh.label_and_sample_proposals(proposals, gt_reg)
    boxes, (_, deltas) = _roi_forward(rh, features, reg_props)
    proposal_boxes = torch.cat([b.tensor for b in boxes])
    gt_boxes = torch.cat([(p.gt_boxes if p.has("gt_boxes") else p.proposal_boxes).tensor
                          for p in reg_props])
    reg_classes = torch.cat([p.gt_classes for p in reg_props])
    losses["loss_box_reg"] = rh.box_predictor.box_reg_loss(proposal_boxes, gt_boxes, deltas,
                                                           reg_classes)
    return losses
