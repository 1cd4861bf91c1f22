"""GradCAM pseudo-boxes from the MVCCL classifier (paper Algorithm 1, DESIGN §3.5)."""
from typing import Optional, Sequence, Tuple

import cv2
import numpy as np
import torch
import torch.nn.functional as F

__all__ = [
    "gradcam_heatmaps",
    "cam_boxes_from_heatmap",
    "scaled_area_limits",
    "boxes_to_original",
]

REF_SIZE = (1536, 768)  # the paper's input size, at which the area limits below are given
AREA_LIMITS = (32**2, 1024**2)


def _minmax(cam: torch.Tensor) -> torch.Tensor:
    """Per-image min-max to [0, 1] over the last two dims; a constant map becomes all zero."""
    flat = cam.flatten(1)
    lo = flat.min(dim=1).values[:, None, None]
    span = flat.max(dim=1).values[:, None, None] - lo
    return torch.where(span > 1e-12, (cam - lo) / span.clamp_min(1e-12), torch.zeros_like(cam))


def gradcam_heatmaps(
    model, batched_inputs, target_size: Optional[Tuple[int, int]] = None
) -> Tuple[np.ndarray, np.ndarray]:
    """GradCAM of the malignancy logit at the main view's fused last-stage features.

    The target is `bottom_up.lcm.to_main`'s output ũ_m (encoder res5 when single-view), computed
    through the full two-view model. weights = spatial mean of d logit / d A; cam = ReLU(Σ w A),
    bilinearly upsampled to the input size (then optionally to `target_size` (H, W)) and
    min-max normalised per image (an all-zero map stays zero).

    Returns (heatmaps float32 (B, H, W) in [0, 1], probs float32 (B,)). Runs in eval mode (the
    model's mode is restored) and with gradients on, even when called under torch.no_grad().
    """
    model = model.module if hasattr(model, "module") else model
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            feats, logits = model.forward_features(batched_inputs)
            # Per-image logits are independent in eval mode, so one backward of the sum gives
            # every image's own gradient.
            (grads,) = torch.autograd.grad(logits.sum(), feats)
    finally:
        model.train(was_training)
    with torch.no_grad():
        weights = grads.mean(dim=(2, 3), keepdim=True)
        cam = F.relu((weights * feats).sum(dim=1, keepdim=True))
        stride = model.bottom_up.size_divisibility
        padded = (cam.shape[-2] * stride, cam.shape[-1] * stride)
        cam = F.interpolate(cam, size=padded, mode="bilinear", align_corners=False)
        h, w = batched_inputs[0]["image"].shape[-2:]
        if any(tuple(x["image"].shape[-2:]) != (h, w) for x in batched_inputs):
            raise ValueError("gradcam_heatmaps needs inputs of one (canonical) size")
        cam = cam[:, :, :h, :w]  # drop the ImageList padding (none at canonical sizes)
        if target_size is not None and tuple(target_size) != (h, w):
            cam = F.interpolate(cam, size=tuple(target_size), mode="bilinear",
                                align_corners=False)
        heat = _minmax(cam[:, 0]).clamp_(0, 1)
        probs = torch.sigmoid(logits.detach())
    return heat.cpu().numpy().astype(np.float32), probs.cpu().numpy().astype(np.float32)


def scaled_area_limits(
    canonical_size: Tuple[int, int], ref_size: Tuple[int, int] = REF_SIZE,
    limits: Tuple[float, float] = AREA_LIMITS,
) -> Tuple[float, float]:
    """Scale the (min, max) component areas given at `ref_size` to `canonical_size` (H, W)."""
    s = (canonical_size[0] * canonical_size[1]) / float(ref_size[0] * ref_size[1])
    return limits[0] * s, limits[1] * s


def cam_boxes_from_heatmap(
    heatmap: np.ndarray, tau: float = 0.5, min_area: float = AREA_LIMITS[0],
    max_area: float = AREA_LIMITS[1],
) -> np.ndarray:
    """Algorithm 1 lines 6-15: threshold at τ, 8-connected components, area filter, boxes.

    Returns float32 (K, 4) XYXY boxes in heatmap (canonical) pixels; a component covering pixel
    columns x..x+w-1 gives x0 = x, x1 = x + w (detectron2 XYXY_ABS convention).
    """
    binary = (np.asarray(heatmap) > tau).astype(np.uint8)
    n, _, stats, _ = cv2.connectedComponentsWithStats(binary, connectivity=8)
    boxes = []
    for i in range(1, n):  # 0 is the background
        x, y, w, h, area = stats[i]
        if area < min_area or area > max_area:
            continue
        boxes.append([x, y, x + w, y + h])
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4)


def boxes_to_original(boxes: np.ndarray, tfm, size: Optional[Sequence[int]] = None) -> np.ndarray:
    """Canonical-frame boxes -> original pixels with the original->canonical `tfm`'s inverse.

    `size` (H, W) of the original image, when given, clips the result.
    """
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if len(boxes):
        boxes = np.asarray(tfm.inverse().apply_box(boxes), dtype=np.float64)
        if size is not None:
            boxes[:, 0::2] = boxes[:, 0::2].clip(0, size[1])
            boxes[:, 1::2] = boxes[:, 1::2].clip(0, size[0])
    return boxes.astype(np.float32)
