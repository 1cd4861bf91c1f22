"""Draw ground truth (blue) and detections (red, with scores) on a grey image."""
import os

import cv2
import numpy as np

__all__ = ["draw_overlay", "GT_COLOR", "DET_COLOR"]

GT_COLOR = (255, 0, 0)  # BGR blue
DET_COLOR = (0, 0, 255)  # BGR red


def draw_overlay(image01, gt_boxes=(), det_boxes=(), det_scores=None, out_png=None,
                 max_side=None):
    """Return (and with `out_png`, write) a BGR uint8 overlay.

    image01: HxW float image in [0, 1] (values outside are clipped); boxes XYXY in the image's
    pixels. `max_side` downsizes the result (boxes scaled along) so full-field mammograms give
    manageable PNGs; line width and font scale follow the output size.
    """
    img = np.asarray(image01, dtype=np.float32)
    if img.ndim != 2:
        raise ValueError(f"expected an HxW grey image, got shape {img.shape}")
    gt = np.asarray(gt_boxes, dtype=np.float64).reshape(-1, 4)
    det = np.asarray(det_boxes, dtype=np.float64).reshape(-1, 4)
    scores = None if det_scores is None else np.asarray(det_scores, dtype=np.float64).reshape(-1)
    scale = 1.0
    if max_side and max(img.shape) > max_side:
        scale = max_side / max(img.shape)
        size = (max(1, round(img.shape[1] * scale)), max(1, round(img.shape[0] * scale)))
        img = cv2.resize(img, size, interpolation=cv2.INTER_AREA)
        gt, det = gt * scale, det * scale
    u8 = (np.clip(np.nan_to_num(img), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    out = cv2.cvtColor(u8, cv2.COLOR_GRAY2BGR)
    side = max(out.shape[:2])
    thick = max(1, int(round(side / 400)))
    font = max(0.35, side / 1500)

    def rect(b, color):
        p0 = (int(round(b[0])), int(round(b[1])))
        p1 = (int(round(b[2])), int(round(b[3])))
        cv2.rectangle(out, p0, p1, color, thick, cv2.LINE_8)  # crisp, exact colours
        return p0

    for b in gt:
        rect(b, GT_COLOR)
    for k, b in enumerate(det):
        p0 = rect(b, DET_COLOR)
        if scores is not None and k < len(scores):
            org = (max(p0[0], 0), max(p0[1] - 3 * thick, int(12 * font) + 2))
            cv2.putText(out, f"{scores[k]:.2f}", org, cv2.FONT_HERSHEY_SIMPLEX, font,
                        DET_COLOR, max(1, thick // 2), cv2.LINE_AA)
    if out_png:
        d = os.path.dirname(os.path.abspath(out_png))
        os.makedirs(d, exist_ok=True)
        if not cv2.imwrite(out_png, out):
            raise OSError(f"could not write {out_png}")
    return out
