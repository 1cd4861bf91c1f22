"""BRAIxDet detector: two-view Faster R-CNN (docs/DESIGN.md §3.6), classifier -> detector init."""
import logging
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from detectron2.config import configurable
from detectron2.modeling import META_ARCH_REGISTRY, ROI_HEADS_REGISTRY, GeneralizedRCNN
from detectron2.modeling.postprocessing import detector_postprocess
from detectron2.modeling.roi_heads import FastRCNNOutputLayers, StandardROIHeads
from detectron2.structures import Boxes, ImageList, Instances
from detectron2.utils.events import get_event_storage
from detectron2.utils.file_io import PathManager

from ..utils.checkpoint import safe_torch_load
from ..utils.modules import unwrap
from .backbone import FUSE_FEATURE, max_mean_pool
from .mvccl import build_image_head

__all__ = [
    "MultiViewRCNN",
    "FocalLossROIHeads",
    "softmax_focal_loss",
    "instances_to_original",
    "load_classifier_weights",
    "load_classifier_weights_from_cfg",
]

logger = logging.getLogger(__name__)


def instances_to_original(
    instances: Instances, tfm, size: Optional[Tuple[int, int]] = None
) -> Instances:
    """Map canonical-frame predictions to ORIGINAL pixels with `tfm.inverse()`, clip to `size`.

    `tfm` maps original -> canonical (the mapper's "transforms"); empty boxes after clipping
    are dropped, as detectron2's detector_postprocess does.
    """
    boxes = instances.pred_boxes.tensor
    if len(boxes):
        mapped = tfm.inverse().apply_box(boxes.detach().cpu().numpy().astype(np.float64))
        boxes = torch.as_tensor(np.asarray(mapped, dtype=np.float32), device=boxes.device)
    out = Instances(tuple(size) if size is not None else instances.image_size)
    for k, v in instances.get_fields().items():
        out.set(k, v)
    out.pred_boxes = Boxes(boxes.reshape(-1, 4))
    if size is not None:
        out.pred_boxes.clip(out.image_size)
        out = out[out.pred_boxes.nonempty()]
    return out


@META_ARCH_REGISTRY.register()
class MultiViewRCNN(GeneralizedRCNN):
    """GeneralizedRCNN whose input is [main, aux] stacked as channels (main only single-view).

    Use MODEL.BACKBONE.NAME = "build_braixdet_fpn_backbone". Inputs: "image" and "aux_image"
    (1, H, W) in [0, 1] (canonical frame), optional "instances" (canonical coords),
    "transforms" (original -> canonical), "height"/"width" (original).
    """

    @configurable
    def __init__(self, *, multi_view: bool = True, image_head: Optional[torch.nn.Module] = None,
                 image_loss_weight: float = 0.0, image_score_gate: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.multi_view = multi_view
        # MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT: an image-level loss whose only way to the
        # second view is the LCM's fused res5, a reason for the detector to read that view
        self.image_head = image_head
        self.image_loss_weight = image_loss_weight
        self.image_score_gate = image_score_gate

    @classmethod
    def from_config(cls, cfg):
        ret = super().from_config(cfg)
        b = cfg.MODEL.BRAIXDET
        ret["multi_view"] = bool(b.MULTI_VIEW)
        if b.DET_IMAGE_LOSS_WEIGHT > 0:  # config/checks.py: the braixdet FPN backbone
            c = ret["backbone"].bottom_up.output_shape()[FUSE_FEATURE].channels
            ret["image_head"] = build_image_head(cfg, 2 * c)
            ret["image_loss_weight"] = float(b.DET_IMAGE_LOSS_WEIGHT)
            ret["image_score_gate"] = bool(cfg.TEST.BRAIXDET.IMAGE_SCORE_GATE)
        return ret

    def _features(self, images: ImageList):
        """(bottom-up features, FPN features): the bottom-up's output kept for the image head;
        the FPN passes a dict through its bottom-up, so the encoder runs once."""
        bottom = self.backbone.bottom_up(images.tensor)
        return bottom, self.backbone(bottom)

    def image_logits(self, bottom_up_features: Dict[str, torch.Tensor]) -> torch.Tensor:
        """(B,) malignancy logits from [max, mean] of the fused res5 (ũ_m; u_m single-view)."""
        return self.image_head(max_mean_pool(bottom_up_features[FUSE_FEATURE])).squeeze(1)

    def forward(self, batched_inputs: List[Dict]):
        if not self.training or self.image_head is None:
            return super().forward(batched_inputs)
        # GeneralizedRCNN.forward's steps, with the bottom-up features kept for the image head
        images = self.preprocess_image(batched_inputs)
        gt_instances = ([x["instances"].to(self.device) for x in batched_inputs]
                        if "instances" in batched_inputs[0] else None)
        bottom, features = self._features(images)
        proposals, proposal_losses = self.proposal_generator(images, features, gt_instances)
        _, detector_losses = self.roi_heads(images, features, proposals, gt_instances)
        if self.vis_period > 0 and get_event_storage().iter % self.vis_period == 0:
            self.visualize_training(batched_inputs, proposals)
        labels = torch.tensor([float(x["label"]) for x in batched_inputs], device=self.device)
        losses = {**detector_losses, **proposal_losses}
        losses["loss_image"] = self.image_loss_weight * \
            torch.nn.functional.binary_cross_entropy_with_logits(
                self.image_logits(bottom).float(), labels)
        return losses

    def _gate(self, results: List[Instances], bottom_up_features) -> List[Instances]:
        """TEST.BRAIXDET.IMAGE_SCORE_GATE: each box's score × its image's probability."""
        probs = torch.sigmoid(self.image_logits(bottom_up_features).float())
        for r, p in zip(results, probs):
            r.scores = r.scores * p.to(r.scores.dtype)
        return results

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x.to(self.device) - self.pixel_mean) / self.pixel_std

    def preprocess_image(self, batched_inputs: List[Dict]) -> ImageList:
        images = []
        for x in batched_inputs:
            views = [x["image"]] + ([x["aux_image"]] if self.multi_view else [])
            images.append(torch.cat([self._normalize(v) for v in views], dim=0))
        return ImageList.from_tensors(images, self.backbone.size_divisibility)

    def inference(self, batched_inputs, detected_instances=None, do_postprocess=True):
        if self.image_score_gate and do_postprocess:
            # the scores the outputs carry; the SSL teacher (do_postprocess False) reads the
            # detector's own
            images = self.preprocess_image(batched_inputs)
            bottom, features = self._features(images)
            if detected_instances is None:
                proposals, _ = self.proposal_generator(images, features, None)
                results, _ = self.roi_heads(images, features, proposals, None)
            else:
                detected_instances = [x.to(self.device) for x in detected_instances]
                results = self.roi_heads.forward_with_given_boxes(features, detected_instances)
            results = self._gate(results, bottom)
        else:
            results = super().inference(batched_inputs, detected_instances, do_postprocess=False)
        if not do_postprocess:
            return results
        sizes = [tuple(x["image"].shape[-2:]) for x in batched_inputs]
        return self.postprocess_to_original(results, batched_inputs, sizes)

    @staticmethod
    def postprocess_to_original(results, batched_inputs, image_sizes):
        """Boxes to original pixels via "transforms" when present, else detectron2 rescaling."""
        out = []
        for r, inp, size in zip(results, batched_inputs, image_sizes):
            tfm = inp.get("transforms")
            h, w = inp.get("height"), inp.get("width")
            if tfm is not None:
                r = instances_to_original(r, tfm, (h, w) if h is not None else None)
            else:
                r = detector_postprocess(r, h if h is not None else size[0],
                                         w if w is not None else size[1])
            out.append({"instances": r})
        return out

    @torch.no_grad()
    def inference_exam(
        self, images: Sequence[torch.Tensor], pairs: Sequence[Tuple[int, int]],
        transforms: Optional[Sequence] = None, sizes: Optional[Sequence[Tuple[int, int]]] = None,
    ) -> List[Dict]:
        """Detect on every (main_idx, aux_idx) pair of one exam, encoding each image ONCE.

        images: (1, H, W) tensors in [0, 1], same canonical size. transforms / sizes: optional
        per-IMAGE original->canonical TransformLists and original (height, width); the output
        of pair k uses those of its main image. Returns one {"instances"} per pair, identical
        to calling the model on each pair.
        """
        assert not self.training, "inference_exam is for eval mode"
        bottom_up = self.backbone.bottom_up
        x = ImageList.from_tensors([self._normalize(im) for im in images],
                                   self.backbone.size_divisibility)
        feats = bottom_up.encode(x.tensor)  # one encoder call for the whole exam
        mi = torch.as_tensor([p[0] for p in pairs], device=self.device, dtype=torch.long)
        ai = torch.as_tensor([p[1] for p in pairs], device=self.device, dtype=torch.long)
        main = {k: v[mi] for k, v in feats.items()}
        if self.multi_view:
            main = bottom_up.fuse(main, {k: v[ai] for k, v in feats.items()})
        features = self.backbone(main)  # FPN; the bottom-up passes the dict through
        mains = ImageList(x.tensor[mi], [x.image_sizes[i] for i in mi.tolist()])
        proposals, _ = self.proposal_generator(mains, features, None)
        results, _ = self.roi_heads(mains, features, proposals, None)
        if self.image_score_gate:
            results = self._gate(results, main)
        pseudo_inputs = []
        for m, _a in pairs:
            d = {"image": images[m]}
            if transforms is not None and transforms[m] is not None:
                d["transforms"] = transforms[m]
            if sizes is not None:
                d["height"], d["width"] = sizes[m]
            pseudo_inputs.append(d)
        return self.postprocess_to_original(results, pseudo_inputs, mains.image_sizes)


_DROP_PREFIXES = ("bottom_up.lcm.to_aux.", "gcm.", "head.")


def load_classifier_weights(detector, classifier_state_dict: Dict[str, torch.Tensor]) -> Dict:
    """Initialise the detector's backbone + LCM from an MVCCLClassifier state dict.

    Maps classifier `bottom_up.*` -> detector `backbone.bottom_up.*` (BN buffers included) and
    `head.*` -> `image_head.*` where the detector has one of the same shapes (the head reads
    [max, mean] of ũ_m or u_m, as the detector's does); drops `bottom_up.lcm.to_aux.*`, `gcm.*`
    and any other `head.*` (the paper's multi-view head reads another input). Returns
    dict(loaded, dropped, missing, mismatched): `missing` = detector `backbone.bottom_up.*` keys
    not initialised; `mismatched` = keys present in both with different shapes (not loaded),
    and the image head's where it reads the same input at another hidden width.
    """
    detector = unwrap(detector)
    target = detector.state_dict()
    new, loaded, dropped, mismatched = {}, [], [], []
    state = {(k[len("module."):] if k.startswith("module.") else k): v
             for k, v in classifier_state_dict.items()}
    head = {k: v for k, v in state.items() if k.startswith("head.")}
    # the whole head or none of it: the paper's multi-view head reads 3C, not the 2C summary
    head_fits = bool(head) and all(
        "image_" + k in target and tuple(target["image_" + k].shape) == tuple(v.shape)
        for k, v in head.items())
    first = "head.0.weight"
    if not head_fits and first in head and "image_" + first in target \
            and head[first].shape[1] == target["image_" + first].shape[1]:
        # the same summary read by a head of another width: loading nothing would train the
        # image head from scratch where the user asked for the classifier's
        mismatched += sorted("image_" + k for k in head)
    for k, v in state.items():
        if k in head and head_fits:
            new["image_" + k] = v
            loaded.append("image_" + k)
            continue
        if k.startswith(_DROP_PREFIXES) or not k.startswith("bottom_up."):
            dropped.append(k)
            continue
        tk = "backbone." + k
        if tk not in target:
            dropped.append(k)  # e.g. the LCM of a multi-view classifier -> single-view detector
        elif tuple(target[tk].shape) != tuple(v.shape):
            mismatched.append(tk)
        else:
            new[tk] = v
            loaded.append(tk)
    prefix = "backbone.bottom_up."
    missing = sorted(k for k in target if k.startswith(prefix) and k not in new)
    if new:
        target.update(new)
        detector.load_state_dict(target)
    return {"loaded": sorted(loaded), "dropped": sorted(dropped), "missing": missing,
            "mismatched": sorted(mismatched)}


def load_classifier_weights_from_cfg(detector, cfg) -> Optional[Dict]:
    """Apply MODEL.BRAIXDET.INIT_FROM_CLASSIFIER (a detectron2 checkpoint of the classifier).

    No-op (returns None) when the key is empty. Raises on shape mismatches (a classifier trained
    with another TIMM_MODEL / LCM size) since silently skipping them would train from scratch.
    """
    path = cfg.MODEL.BRAIXDET.INIT_FROM_CLASSIFIER
    if not path:
        return None
    with PathManager.open(path, "rb") as f:
        ckpt = safe_torch_load(f)  # one-line CheckpointRefusedError for a crafted pickle
    state = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else ckpt
    report = load_classifier_weights(detector, state)
    if report["mismatched"]:
        hint = (" (the image head of MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT: set "
                "MODEL.BRAIXDET.CLS_HIDDEN_DIM to the classifier's)"
                if any(k.startswith("image_head.") for k in report["mismatched"]) else "")
        raise ValueError(f"{path}: shape mismatch for {report['mismatched'][:5]} ...{hint}")
    logger.info(
        "Initialised detector from classifier %s: %d tensors loaded, %d dropped, %d missing",
        path, len(report["loaded"]), len(report["dropped"]), len(report["missing"]),
    )
    if report["missing"]:
        logger.warning("Detector tensors not in the classifier: %s", report["missing"][:10])
    return report


def softmax_focal_loss(logits: torch.Tensor, targets: torch.Tensor, gamma: float) -> torch.Tensor:
    """Mean over rows of -(1 - p_t)^gamma log p_t with p_t the softmax probability of the
    target class (Unbiased Teacher's ROI classifier loss); gamma 0 is cross-entropy."""
    if logits.numel() == 0:
        return logits.sum() * 0.0
    ce = torch.nn.functional.cross_entropy(logits.float(), targets, reduction="none")
    p_t = torch.exp(-ce)
    return ((1.0 - p_t) ** gamma * ce).mean()


class _FocalFastRCNNOutputLayers(FastRCNNOutputLayers):
    def __init__(self, cfg, input_shape):
        super().__init__(cfg, input_shape)
        self.focal_gamma = float(cfg.MODEL.BRAIXDET.ROI_FOCAL_GAMMA)

    def losses(self, predictions, proposals):
        losses = super().losses(predictions, proposals)
        scores = predictions[0]
        gt = torch.cat([p.gt_classes for p in proposals]) if proposals else scores.new_zeros(
            0, dtype=torch.long)
        losses["loss_cls"] = softmax_focal_loss(scores, gt, self.focal_gamma) * \
            self.loss_weight.get("loss_cls", 1.0)
        return losses


@ROI_HEADS_REGISTRY.register()
class FocalLossROIHeads(StandardROIHeads):
    """StandardROIHeads whose box classifier is trained with the softmax focal loss
    (MODEL.BRAIXDET.ROI_FOCAL_GAMMA), as Unbiased Teacher's ROI head."""

    @classmethod
    def _init_box_head(cls, cfg, input_shape):
        ret = super()._init_box_head(cfg, input_shape)
        ret["box_predictor"] = _FocalFastRCNNOutputLayers(cfg, ret["box_head"].output_shape)
        return ret
