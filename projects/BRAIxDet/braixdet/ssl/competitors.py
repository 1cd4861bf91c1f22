"""Shared mechanics of the SSL competitors (Unbiased Teacher, Soft Teacher, STAC; issue 22).

* ``threshold_pseudo_targets``: every teacher box with score >= a threshold is a pseudo-box
  (UT 0.7, Soft Teacher 0.5 then 0.9, STAC 0.9), unlike Algorithm 2's single top box; STAC's
  threshold is capped at the image's best score (``keep_top``).
* ``strong_augment``: the student's copy of an image gets the method's strong augmentation
  (``build_strong_augment``: the official STAC / Unbiased Teacher policies, or our older
  colour-affine-cutout one); the teacher saw the weakly augmented original.
* ``keep_loss_terms``: the per-term loss mask on pseudo-labelled images (UT trains only the
  classification terms on them: no box regression from pseudo-boxes).
All in the student's INPUT frame, as ssl/pseudo_labels.py.
"""
import torch
from detectron2.structures import Boxes, Instances
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

__all__ = ["threshold_pseudo_targets", "strong_augment", "keep_loss_terms", "StrongAugment",
           "StacAugment", "UnbiasedTeacherAugment", "build_strong_augment", "STRONG_AUG_POLICIES",
           "PSEUDO_LABEL_MODES"]

# SSL.PSEUDO_LABELS: "top1" = Algorithm 2 (ssl/pseudo_labels.py); "threshold" = every teacher box
# over SSL.TEACHER_SCORE_THRESH (threshold_pseudo_targets)
PSEUDO_LABEL_MODES = ("top1", "threshold")


def _instances(out):
    return out["instances"] if isinstance(out, dict) else out


def threshold_pseudo_targets(teacher_outputs, weak_inputs, score_thresh, keep_top=False):
    """Per weak input, Instances with every teacher box whose score >= ``score_thresh``
    (``gt_boxes``, ``gt_classes``, and the teacher's ``gt_scores``); an image without such a box
    gets empty targets (all background), as in Unbiased/Soft Teacher. ``keep_top``: the
    threshold is min(score_thresh, the image's best score), so an image with any teacher box
    keeps at least its best one (STAC's ssl_detection/detection/data.py, get_pseudo_gt)."""
    if len(teacher_outputs) != len(weak_inputs):
        raise ValueError(f"{len(teacher_outputs)} teacher outputs for {len(weak_inputs)} inputs")
    targets = []
    for out, inp in zip(teacher_outputs, weak_inputs):
        inst = _instances(out)
        size = tuple(int(x) for x in inp["image"].shape[-2:])
        thresh = score_thresh
        if keep_top and len(inst):
            thresh = min(float(score_thresh), float(inst.scores.max()))
        keep = inst.scores >= thresh
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
    """Our first policy ("affine"; no official method's): colour jitter, random affine
    (translate/scale) and cutout on a (C, H, W) image in [0, 1] with its boxes; torchvision's v2
    transforms move the boxes with the geometry. Randomness is torch's (reseeded per iteration
    by the trainer, so a resumed run draws the same)."""

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


def _uniform(lo, hi):
    return float(lo + (hi - lo) * torch.rand(()))


def _randint(lo, hi):
    """Uniform integer in [lo, hi] (both included), from torch's RNG."""
    return int(torch.randint(lo, hi + 1, ()))


class StacAugment:
    """STAC's strong augmentation (google-research/ssl_detection detection/utils/augmentation.py,
    ``RandomAugmentBBox("strong")``), re-written with torchvision on a (C, H, W) image in [0, 1]:
    one colour op and one geometric op in random order, then 1-5 cut-outs.

    * colour: one of Identity, AutoContrast, Equalize, Solarize, Color, Contrast, Brightness,
      Sharpness, Posterize at level L in 1..9 of 10 (AutoAugment's scales: enhance factor
      0.1 + 1.8 L/10, solarize threshold 1 - L/10, posterize 4 - int(0.4 L) bits). Color
      (saturation) is the identity on a one-channel mammogram.
    * geometric, one of: a global affine (boxes moved with it), one of translate-x/y ±10 %,
      rotate ±30°, shear ±30°; or the in-box affine: one pseudo-box's content gets a small
      affine (translate ±5 %, rotate ±10°, shear ±10°), boxes unchanged. Fill 125/255 (theirs).
    * cut-out: 1-5 squares of side U(0, 0.2) × the image height, filled with 128/255 (imgaug's
      Cutout defaults).
    """

    COLOR_OPS = ("identity", "autocontrast", "equalize", "solarize", "color", "contrast",
                 "brightness", "sharpness", "posterize")
    FILL = 125.0 / 255.0
    CUTOUT_FILL = 128.0 / 255.0

    def color(self, image, op, level):
        f = 0.1 + 1.8 * level / 10.0
        if op == "autocontrast":
            return F.autocontrast(image)
        if op == "equalize":
            return F.equalize(image)
        if op == "solarize":
            return F.solarize(image, 1.0 - int(level * 256 / 10) / 256.0)
        if op == "color":
            return F.adjust_saturation(image, f)
        if op == "contrast":
            return F.adjust_contrast(image, f)
        if op == "brightness":
            return F.adjust_brightness(image, f)
        if op == "sharpness":
            return F.adjust_sharpness(image, f)
        if op == "posterize":
            return F.posterize(image, 4 - int(level * 4 / 10))
        return image

    @staticmethod
    def _affine_params(h, w, small):
        """One of translate-x, translate-y, rotate, shear (x), STAC's ranges."""
        t, deg = (0.05, 10.0) if small else (0.1, 30.0)
        kind = _randint(0, 3)
        p = {"angle": 0.0, "translate": [0, 0], "scale": 1.0, "shear": [0.0, 0.0]}
        if kind == 0:
            p["translate"] = [round(_uniform(-t, t) * w), 0]
        elif kind == 1:
            p["translate"] = [0, round(_uniform(-t, t) * h)]
        elif kind == 2:
            p["angle"] = _uniform(-deg, deg)
        else:
            p["shear"] = [_uniform(-deg, deg), 0.0]
        return p

    def geometric(self, image, boxes):
        h, w = image.shape[-2:]
        if _randint(0, 1) == 0 or len(boxes) == 0:  # global affine, boxes follow
            bb = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w))
            p = self._affine_params(h, w, small=False)
            img = F.affine(tv_tensors.Image(image), **p, fill=self.FILL)
            bb = F.affine(bb, **p)
            return img.as_subclass(torch.Tensor), bb.as_subclass(torch.Tensor)
        k = _randint(0, len(boxes) - 1)  # in-box affine on one box's content
        x0, y0, x1, y1 = (int(v) for v in boxes[k].clamp(min=0).tolist())
        x1, y1 = min(x1, w), min(y1, h)
        if x1 - x0 < 1 or y1 - y0 < 1:
            return image, boxes
        crop = image[..., y0:y1, x0:x1]
        p = self._affine_params(y1 - y0, x1 - x0, small=True)
        out = image.clone()
        out[..., y0:y1, x0:x1] = F.affine(crop, **p, fill=self.FILL)
        return out, boxes

    def cutout(self, image):
        h, w = image.shape[-2:]
        out = image.clone()
        for _ in range(_randint(1, 5)):
            side = int(_uniform(0.0, 0.2) * h)
            cy, cx = _uniform(0, h), _uniform(0, w)
            y0, x0 = max(int(cy - side / 2), 0), max(int(cx - side / 2), 0)
            out[..., y0:max(int(cy + side / 2), y0), x0:max(int(cx + side / 2), x0)] = \
                self.CUTOUT_FILL
        return out

    def __call__(self, image, boxes):
        boxes = boxes.reshape(-1, 4).float()
        for step in torch.randperm(2).tolist():  # colour and geometric in random order
            if step == 0:
                op = self.COLOR_OPS[_randint(0, len(self.COLOR_OPS) - 1)]
                image = self.color(image, op, _randint(1, 9))
            else:
                image, boxes = self.geometric(image, boxes)
        return self.cutout(image), boxes


class UnbiasedTeacherAugment:
    """Unbiased Teacher's strong augmentation (facebookresearch/unbiased-teacher
    ubteacher/data/detection_utils.py ``build_strong_augmentation``), photometric only, so
    boxes are unchanged: colour jitter (0.4, 0.4, 0.4, 0.1) with p 0.8, grayscale p 0.2,
    Gaussian blur σ ∈ [0.1, 2] with p 0.5, then three random erasings with random values.
    Saturation, hue and grayscale do nothing on a one-channel mammogram."""

    def __init__(self):
        # PIL's GaussianBlur(radius=σ) has no kernel size; 13 covers ± 3σ at σ = 2
        self.tfm = v2.Compose([
            v2.RandomApply([v2.ColorJitter(0.4, 0.4, 0.4, 0.1)], p=0.8),
            v2.RandomGrayscale(p=0.2),
            v2.RandomApply([v2.GaussianBlur(13, sigma=(0.1, 2.0))], p=0.5),
            v2.RandomErasing(p=0.7, scale=(0.05, 0.2), ratio=(0.3, 3.3), value="random"),
            v2.RandomErasing(p=0.5, scale=(0.02, 0.2), ratio=(0.1, 6), value="random"),
            v2.RandomErasing(p=0.3, scale=(0.02, 0.2), ratio=(0.05, 8), value="random"),
        ])

    def __call__(self, image, boxes):
        return self.tfm(image), boxes


STRONG_AUG_POLICIES = {"affine": StrongAugment, "stac": StacAugment,
                       "unbiased_teacher": UnbiasedTeacherAugment}


def build_strong_augment(policy):
    """The strong augmentation named ``policy`` (cfg SSL.STRONG_AUG_POLICY)."""
    if policy not in STRONG_AUG_POLICIES:
        raise ValueError(f"SSL.STRONG_AUG_POLICY must be one of {sorted(STRONG_AUG_POLICIES)}, "
                         f"got {policy!r}")
    return STRONG_AUG_POLICIES[policy]()


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
