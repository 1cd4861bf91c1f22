"""Soft Teacher's two mechanisms (Xu et al. 2021, §3.2-3.3), on our Faster R-CNN.

* Background weighting: on pseudo-labelled images the student's background proposals are
  weighted by the teacher's background score on the same boxes,
  L_cls = 1/N_fg Σ_fg ℓ + Σ_bg w_j ℓ_j with w_j = r_j / Σ_k r_k.
* Box jittering: a pseudo-box trains box regression only when the teacher's refinements of
  ``times`` jittered copies of it vary little (mean std of the 4 coordinates over the box's
  width/height below a threshold; the paper: 10 jitters, scale 0.06, threshold 0.02).
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
    """Soft Teacher's classification loss; background = the last class index."""
    bg_class = logits.shape[1] - 1
    ce = F.cross_entropy(logits.float(), gt_classes, reduction="none")
    fg = gt_classes != bg_class
    loss = ce[fg].sum() / max(int(fg.sum()), 1)
    r = bg_scores[~fg].float()
    if len(r):
        loss = loss + (r / r.sum().clamp(min=1e-12) * ce[~fg]).sum()
    return loss


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


def box_uncertainty(boxes, refined_jitters):
    """Mean over the 4 coordinates of the std over jitters, each over the box's width (x) or
    height (y): ``refined_jitters`` (times, n, 4) for ``boxes`` (n, 4)."""
    wh = (boxes[:, 2:] - boxes[:, :2]).clamp(min=1.0)
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
        out.append(box_uncertainty(t.gt_boxes.tensor, r) < thresh if n else
                   torch.zeros(0, dtype=torch.bool, device=r.device))
    return out


def soft_teacher_losses(student, teacher, batch):
    """The student's losses on pseudo-labelled ``batch`` (instances carry ``gt_reg_ok``):
    RPN losses, background-weighted classification, regression only from reliable boxes."""
    s = unwrap(student)
    images = s.preprocess_image(batch)
    gt = [x["instances"].to(s.device) for x in batch]
    features = s.backbone(images.tensor)
    proposals, losses = s.proposal_generator(images, features, gt)
    rh = s.roi_heads
    proposals = rh.label_and_sample_proposals(proposals, gt)
    feats = [features[f] for f in rh.box_in_features]
    boxes = [p.proposal_boxes for p in proposals]
    scores, deltas = rh.box_predictor(rh.box_head(rh.box_pooler(feats, boxes)))
    gt_classes = torch.cat([p.gt_classes for p in proposals])
    bg_class = scores.shape[1] - 1
    probs, _ = teacher_box_outputs(teacher, batch, [b.tensor.detach() for b in boxes])
    losses["loss_cls"] = background_weighted_cls_loss(scores, gt_classes, probs[:, bg_class])
    # regression: proposals matched to an unreliable pseudo-box count as background here only
    reg_ok = torch.cat([p.gt_reg_ok if p.has("gt_reg_ok") else
                        torch.zeros(len(p), dtype=torch.bool, device=s.device)
                        for p in proposals])
    reg_classes = torch.where(reg_ok, gt_classes, torch.full_like(gt_classes, bg_class))
    proposal_boxes = torch.cat([b.tensor for b in boxes])
    gt_boxes = torch.cat([(p.gt_boxes if p.has("gt_boxes") else p.proposal_boxes).tensor
                          for p in proposals])
    losses["loss_box_reg"] = rh.box_predictor.box_reg_loss(proposal_boxes, gt_boxes, deltas,
                                                           reg_classes)
    return losses
