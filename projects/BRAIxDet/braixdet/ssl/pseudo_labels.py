"""Pseudo-labels for weakly annotated images (paper §3.3, Algorithm 2; docs/DESIGN.md §4).

For a weak image with label 1 the pseudo-label is the teacher's single most confident box (after
the teacher's own test NMS). During the first epochs of D_w (``cam_phase_active``) it is fused with
the image's GradCAM boxes (Algorithm 1 output): union, then NMS with τ_nms. Label-0 images train as
all background (configurable). An image with no box at all adds no weak loss (``None``).

Everything here is in the INPUT frame (canonical, plus any training augmentation): the trainer
runs the teacher's inference WITHOUT mapping boxes back to original pixels, and maps the GradCAM
boxes (stored in original pixels, see cam_boxes.py) into that frame before calling this.
"""
import math

import torch
from detectron2.structures import Boxes, Instances
from torchvision.ops import nms

__all__ = [
    "teacher_top1",
    "teacher_instances",
    "fuse_teacher_and_cam",
    "make_pseudo_targets",
    "cam_phase_active",
    "fusion_iters_from_cfg",
]


def _as_boxes_scores(boxes, scores):
    boxes = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    scores = torch.as_tensor(scores, dtype=torch.float32).reshape(-1)
    if len(boxes) != len(scores):
        raise ValueError(f"{len(boxes)} boxes but {len(scores)} scores")
    return boxes, scores


def teacher_top1(instances, score_thresh=0.0):
    """The teacher's most confident detection.

    Args:
        instances: teacher output Instances (``pred_boxes``, ``scores``), already after the
            teacher's test NMS, in canonical coordinates.
        score_thresh: the box is dropped when its score is below this.
    Returns:
        (boxes (k, 4) float32, scores (k,) float32) with k in {0, 1}, on the instances' device.
    """
    if instances is None or len(instances) == 0:
        return torch.zeros(0, 4), torch.zeros(0)
    boxes = instances.pred_boxes
    boxes = boxes.tensor if isinstance(boxes, Boxes) else torch.as_tensor(boxes)
    scores = instances.scores
    j = int(torch.argmax(scores))
    if float(scores[j]) < score_thresh:
        return boxes.new_zeros(0, 4).float(), scores.new_zeros(0).float()
    return boxes[j : j + 1].detach().float(), scores[j : j + 1].detach().float()


def fuse_teacher_and_cam(teacher_boxes, teacher_scores, cam_boxes, cam_scores, nms_thresh=0.2):
    """Algorithm 2: NMS over the union of the teacher's box and the GradCAM boxes.

    Uses torchvision's NMS (suppresses IoU > τ; Algorithm 2 writes ≥ τ — equal only on ties).
    Returns (boxes (k, 4), scores (k,)) sorted by decreasing score.
    """
    tb, ts = _as_boxes_scores(teacher_boxes, teacher_scores)
    cb, cs = _as_boxes_scores(cam_boxes, cam_scores)
    cb, cs = cb.to(tb.device), cs.to(tb.device)
    boxes, scores = torch.cat([tb, cb]), torch.cat([ts, cs])
    if len(boxes) == 0:
        return boxes, scores
    keep = nms(boxes, scores, float(nms_thresh))
    return boxes[keep], scores[keep]


def _image_size(inp):
    img = inp.get("image")
    if img is None:
        raise KeyError("weak input has no 'image' tensor (needed for the pseudo-label image_size)")
    return tuple(int(x) for x in img.shape[-2:])


def teacher_instances(out):
    # GeneralizedRCNN.inference(..., do_postprocess=False) returns Instances; forward returns dicts.
    return out["instances"] if isinstance(out, dict) else out


def _empty_targets(image_size, device):
    inst = Instances(image_size)
    inst.gt_boxes = Boxes(torch.zeros(0, 4, device=device))
    inst.gt_classes = torch.zeros(0, dtype=torch.int64, device=device)
    return inst


def make_pseudo_targets(
    teacher_outputs,
    weak_inputs,
    cam_lookup=None,
    use_cam=False,
    negative_as_background=True,
    nms_thresh=0.2,
    score_thresh=0.0,
    stats=None,
):
    """Build the student's targets for a batch of weak images.

    Args:
        teacher_outputs: per weak input, the teacher's Instances (or ``{"instances": ...}``) with
            ``pred_boxes`` and ``scores`` in CANONICAL coordinates, i.e. the teacher's inference
            run WITHOUT postprocessing back to original pixels (e.g.
            ``teacher.inference(inputs, do_postprocess=False)``), on the same (augmented) images
            the student sees.
        weak_inputs: the mapper dicts: "image" (C, H, W), "label" (0/1), "image_id".
        cam_lookup: dict image_id -> (boxes (n, 4), scores (n,)) with the boxes ALREADY in the
            frame of ``weak_inputs[i]["image"]`` (canonical, plus any training augmentation such
            as the vertical flip: the caller maps them, nothing is re-applied here); a missing id
            = no CAM box.
        use_cam: fuse the CAM boxes (Algorithm 2), i.e. ``cam_phase_active(iter, fusion_iters)``.
        negative_as_background: label-0 images get empty targets (all anchors/proposals are
            background); otherwise they get ``None``.
        stats: optional dict, incremented with counts for logging ("teacher", "cam", "boxes",
            "negative", "skipped").
    Returns:
        list (one per input) of Instances(image_size=(H, W)) with ``gt_boxes`` (Boxes) and
        ``gt_classes`` (int64 zeros), or None when the image must add no weak loss.
    """
    if len(teacher_outputs) != len(weak_inputs):
        raise ValueError(f"{len(teacher_outputs)} teacher outputs for {len(weak_inputs)} inputs")
    stats = {} if stats is None else stats
    for k in ("teacher", "cam", "boxes", "negative", "skipped"):
        stats.setdefault(k, 0)
    cam_lookup = cam_lookup or {}
    targets = []
    for out, inp in zip(teacher_outputs, weak_inputs):
        size = _image_size(inp)
        inst = teacher_instances(out)
        device = inst.scores.device if inst is not None and inst.has("scores") else "cpu"
        if int(inp["label"]) == 0:
            stats["negative"] += 1
            targets.append(_empty_targets(size, device) if negative_as_background else None)
            continue

        boxes, scores = teacher_top1(inst, score_thresh)
        stats["teacher"] += len(boxes)
        cam = cam_lookup.get(inp.get("image_id"), cam_lookup.get(str(inp.get("image_id"))))
        if use_cam and cam is not None:
            cb, cs = _as_boxes_scores(*cam)
            stats["cam"] += len(cb)
            boxes, scores = fuse_teacher_and_cam(boxes, scores, cb, cs, nms_thresh)

        gt = Boxes(boxes.to(device))
        gt.clip(size)
        gt = gt[gt.nonempty()]
        if len(gt) == 0:
            stats["skipped"] += 1
            targets.append(None)
            continue
        stats["boxes"] += len(gt)
        t = Instances(size)
        t.gt_boxes = gt
        t.gt_classes = torch.zeros(len(gt), dtype=torch.int64, device=device)
        targets.append(t)
    return targets


def cam_phase_active(iteration, fusion_iters):
    """True while the CAM boxes are fused (0-based iteration < fusion_iters)."""
    return iteration < fusion_iters


def fusion_iters_from_cfg(num_weak_images, weak_batch_size, epochs=2.0, override_iters=-1):
    """Iterations of the CAM-fusion phase: ceil(epochs × |D_w| / weak batch) (paper: 2 epochs),
    or ``override_iters`` when it is >= 0 (cfg SSL.CAM_FUSION_ITERS / CAM_FUSION_EPOCHS,
    DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH is the global weak batch)."""
    if override_iters is not None and override_iters >= 0:
        return int(override_iters)
    if weak_batch_size <= 0:
        raise ValueError(f"weak batch size must be positive, got {weak_batch_size}")
    if num_weak_images < 0 or epochs < 0:
        raise ValueError(f"bad fusion phase: {num_weak_images} images, {epochs} epochs")
    # the tolerance keeps e.g. 0.1 * 30 / 3 = 1.0000000000000002 at 1
    return int(math.ceil(epochs * num_weak_images / weak_batch_size - 1e-9))
