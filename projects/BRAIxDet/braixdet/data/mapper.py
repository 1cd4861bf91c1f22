"""Dataset dict (docs/DESIGN.md §2) -> model input: canonical main + aux views, canonical boxes."""
import logging
import os

import numpy as np
import torch
from detectron2.config import configurable
from detectron2.data import transforms as T
from detectron2.structures import Boxes, BoxMode, Instances

from .cache import CanonicalCache
from .preprocess import PreprocessParams
from .report import BadInputError

logger = logging.getLogger(__name__)

__all__ = ["MultiViewDatasetMapper", "default_cache_dir"]


def default_cache_dir(cfg):
    """INPUT.BRAIXDET.CACHE_DIR, or ``<OUTPUT_DIR>/../cache`` (shared by runs) when empty."""
    return cfg.INPUT.BRAIXDET.CACHE_DIR or os.path.normpath(
        os.path.join(os.path.abspath(cfg.OUTPUT_DIR), "..", "cache"))


class MultiViewDatasetMapper:
    """Loads main and auxiliary canonical images from the CanonicalCache (computed on a miss).

    Output: "image", "aux_image" float32 (1, H, W) in [0, 1]; "instances" (canonical, after
    augmentation) for full dicts, also empty for lesion-free full images, absent for weak ones;
    "label", "annotation_type", "image_id", "file_name", "height", "width" (original);
    "transforms" (original -> canonical of the main view, without augmentation) and
    "aug_transforms" (canonical -> augmented canonical, geometric part; empty at test time), so
    original-pixel boxes (e.g. GradCAM pseudo-boxes) map into the training frame with
    ``aug_transforms.apply_box(transforms.apply_box(b))``.

    Training augmentation (paper: no cutout / colour jitter): vertical flip of both views together
    (keeps the nipple on the right) and a mild intensity change (scale ``1 ± BRIGHTNESS`` and gamma
    ``exp(± CONTRAST)``, both keep the zeroed background at 0), drawn from
    ``default_rng((aug_seed, dataset_dict["_draw"]))`` so an exact resume reproduces it.
    A file that cannot be loaded is logged in one line and the mapper returns None.
    """

    @configurable
    def __init__(self, is_train=True, *, canonical_size=(1536, 768), cache_dir, margin=0.02,
                 downsample=8, aug_enabled=True, vflip_prob=0.5, brightness=0.1, contrast=0.1,
                 aug_seed=0, allow_for_processing=False, cache_format="npy"):
        self.is_train = is_train
        self.params = PreprocessParams(tuple(canonical_size), float(margin), int(downsample))
        self.cache = CanonicalCache(cache_dir, self.params,
                                    allow_for_processing=allow_for_processing, fmt=cache_format)
        self.augment = bool(is_train and aug_enabled)
        self.vflip_prob, self.brightness, self.contrast = vflip_prob, brightness, contrast
        self.aug_seed = int(aug_seed)

    @classmethod
    def from_config(cls, cfg, is_train=True):
        i = cfg.INPUT.BRAIXDET
        return {
            "is_train": is_train,
            "canonical_size": tuple(i.CANONICAL_SIZE),
            "cache_dir": default_cache_dir(cfg),
            "margin": i.MASK_MARGIN,
            "downsample": i.MASK_DOWNSAMPLE,
            "aug_enabled": i.AUG.ENABLED,
            "vflip_prob": i.AUG.VFLIP_PROB,
            "brightness": i.AUG.BRIGHTNESS,
            "contrast": i.AUG.CONTRAST,
            "aug_seed": cfg.SEED if cfg.SEED >= 0 else 0,
            "allow_for_processing": i.get("ALLOW_FOR_PROCESSING", False),
            "cache_format": i.get("CACHE_FORMAT", "npy"),
        }

    def _rng(self, dataset_dict):
        draw = dataset_dict.get("_draw")
        if draw is None:  # plain detectron2 loaders: not reproducible, but still augmented
            return np.random.default_rng()
        return np.random.default_rng([self.aug_seed, int(draw)])

    def __call__(self, dataset_dict):
        d = dataset_dict
        try:
            img, tfm = self.cache.get(d["file_name"], d.get("laterality"))
            aux_name = d.get("aux_file_name") or d["file_name"]
            if aux_name == d["file_name"]:
                aux = img
            else:
                aux, _ = self.cache.get(aux_name, d.get("laterality"))
        except (BadInputError, ValueError) as e:  # ValueError: e.g. an empty image
            logger.warning("skipping %s: %s", d.get("image_id"), str(e).replace("\n", " "))
            return None

        h, w = self.params.canonical_size
        aug = T.TransformList([])
        if self.augment:
            rng = self._rng(d)
            if rng.uniform() < self.vflip_prob:
                aug = T.TransformList([T.VFlipTransform(h)])
                img, aux = img[::-1], aux[::-1]
            scale = 1.0 + rng.uniform(-self.brightness, self.brightness)
            gamma = float(np.exp(rng.uniform(-self.contrast, self.contrast)))
            img = np.clip(np.power(img, gamma) * scale, 0.0, 1.0)
            aux = np.clip(np.power(aux, gamma) * scale, 0.0, 1.0)

        out = {
            "image": torch.from_numpy(np.ascontiguousarray(img, dtype=np.float32)[None]),
            "aux_image": torch.from_numpy(np.ascontiguousarray(aux, dtype=np.float32)[None]),
            "label": int(d["label"]),
            "annotation_type": d["annotation_type"],
            "image_id": d["image_id"],
            "file_name": d["file_name"],
            "height": int(d["height"]),
            "width": int(d["width"]),
            "aux_missing": bool(d.get("aux_missing", False)),
            "transforms": tfm,
            "aug_transforms": aug,
        }
        if d["annotation_type"] == "full":
            out["instances"] = self._instances(d.get("annotations", []), tfm, aug, (h, w))
        return out

    @staticmethod
    def _instances(annos, tfm, aug, image_size):
        h, w = image_size
        boxes = np.array([BoxMode.convert(a["bbox"], a["bbox_mode"], BoxMode.XYXY_ABS)
                          for a in annos], dtype=np.float64).reshape(-1, 4)
        if len(boxes):
            boxes = aug.apply_box(tfm.apply_box(boxes))
            boxes[:, 0::2] = boxes[:, 0::2].clip(0, w)
            boxes[:, 1::2] = boxes[:, 1::2].clip(0, h)
            # a lesion outside the breast crop (rare) is lost: keep only boxes with area
            boxes = boxes[(boxes[:, 2] - boxes[:, 0] >= 1) & (boxes[:, 3] - boxes[:, 1] >= 1)]
        inst = Instances(image_size)
        inst.gt_boxes = Boxes(torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4))
        inst.gt_classes = torch.zeros(len(boxes), dtype=torch.int64)
        return inst
