"""Shared mechanics of the SSL competitors (Unbiased Teacher, Soft Teacher, STAC; issue 22).

* ``threshold_pseudo_targets``: every teacher box with score >= a threshold is a pseudo-box
  (UT 0.7, Soft Teacher 0.9, STAC 0.9), unlike Algorithm 2's single top box.
* ``strong_augment``: the student's copy of a weak image gets colour jitter, a random affine
  (boxes transformed with it) and cutout; the teacher saw the weakly augmented original.
* ``keep_loss_terms``: the per-term loss mask on pseudo-labelled images (UT trains only the
  classification terms on them: no box regression from pseudo-boxes).
All in the student's INPUT frame, as ssl/pseudo_labels.py.
"""
import torch
from detectron2.structures import Boxes, Instances
from torchvision import tv_tensors
from torchvision.transforms import v2

__all__ = ["threshold_pseudo_targets", "strong_augment", "keep_loss_terms", "StrongAugment"]


def _instances(out):
    return out["instances"] if isinstance(out, dict) else out


def threshold_pseudo_targets(teacher_outputs, weak_inputs, score_thresh):
    """Per weak input, Instances with every teacher box whose score >= ``score_thresh``
    (``gt_boxes``, ``gt_classes``, and the teacher's ``gt_scores``); an image without such a box
    gets empty targets (all background), as in Unbiased/Soft Teacher."""
    if len(teacher_outputs) != len(weak_inputs):
        raise ValueError(f"{len(teacher_outputs)} teacher outputs for {len(weak_inputs)} inputs")
    targets = []
    for out, inp in zip(teacher_outputs, weak_inputs):
        inst = _instances(out)
        size = tuple(int(x) for x in inp["image"].shape[-2:])
        keep = inst.scores >= score_thresh
        boxes = Boxes(inst.pred_boxes.tensor[keep].detach().float())
        boxes.clip(size)
        t = Instances(size)
        t.gt_boxes = boxes
        t.gt_classes = inst.pred_classes[keep].detach().long()
        t.gt_scores = inst.scores[keep].detach().float()
        ok = boxes.nonempty()
        targets.append(t[ok])
    return targets


class StrongAugment:
    """Colour jitter, random affine (translate/scale) and cutout on a (C, H, W) image in [0, 1]
    with its boxes; torchvision's v2 transforms move the boxes with the geometry. Randomness is
    torch's (reseeded per iteration by the trainer, so a resumed run draws the same)."""

    def __init__(self, color=0.4, translate=0.1, scale=(0.9, 1.1), cutout_p=0.7):
        self.tfm = v2.Compose([
            v2.ColorJitter(brightness=color, contrast=color),
            v2.RandomAffine(degrees=0, translate=(translate, translate), scale=tuple(scale)),
        ])
        self.cutout = v2.RandomErasing(p=cutout_p, scale=(0.02, 0.1), value=0)  # pixels only

    def __call__(self, image, boxes):
        h, w = image.shape[-2:]
        bb = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w))
        out, out_boxes = self.tfm(tv_tensors.Image(image), bb)
        out = self.cutout(out.as_subclass(torch.Tensor))
        return out, out_boxes.as_subclass(torch.Tensor)


def strong_augment(example, augment):
    """A NEW dict: ``example``'s image and pseudo-boxes strongly augmented (the input dict, which
    the teacher saw, is left unchanged). Boxes leaving the image are dropped with their fields."""
    inst = example["instances"]
    image, boxes = augment(example["image"], inst.gt_boxes.tensor)
    new = Instances(inst.image_size)
    for k, v in inst.get_fields().items():
        new.set(k, v)
    new.gt_boxes = Boxes(boxes.reshape(-1, 4).float())
    new.gt_boxes.clip(inst.image_size)
    new = new[new.gt_boxes.nonempty()]
    return dict(example, image=image, instances=new)


def keep_loss_terms(loss_dict, keep):
    """The loss terms named in ``keep`` (all when ``keep`` is empty); an unknown name is an
    error, so a misspelt config key cannot silently drop every term."""
    if not keep:
        return dict(loss_dict)
    unknown = set(keep) - set(loss_dict)
    if unknown:
        raise KeyError(f"SSL.UNSUP_LOSSES names {sorted(unknown)}, the model returns "
                       f"{sorted(loss_dict)}")
    return {k: v for k, v in loss_dict.items() if k in keep}
