"""The package's one drawing module: ground truth (blue) and detections (red, with scores) on a
grey image, as PNGs.

* ``draw_overlay``: one image (float in [0, 1], or the uint8 ``display_image`` of a decoded
  DICOM) with its boxes; ``exam_montage``: an exam's overlays side by side (tools/predict.py);
* ``render`` with ``load_predictions`` / ``dataset_items`` / ``dicom_items``: the PNGs of
  tools/visualize.py and of the demo. Predictions: COCO results (detections_coco.json: image_id,
  bbox xywh, score; image ids mapped back through "braixdet_image_id" or the gt_coco.json next
  to it) or tools/predict.py's predictions.json. Boxes are in original DICOM pixels; with
  canonical preprocessing parameters they are drawn on the canonical image, mapped with the
  preprocessing transform.
"""
import json
import logging
import os
from collections import defaultdict

import cv2
import numpy as np
from detectron2.data import DatasetCatalog
from detectron2.structures import BoxMode

from ..data.dicom import read_dicom_image, read_dicom_meta
from ..data.preprocess import canonicalize
from ..utils import safe_output_path

__all__ = ["DET_COLOR", "GT_COLOR", "dataset_items", "dicom_items", "display_image",
           "draw_overlay", "exam_montage", "load_predictions", "render"]

logger = logging.getLogger(__name__)
EMPTY = (np.zeros((0, 4)), np.zeros(0))
GT_COLOR = (255, 0, 0)  # BGR blue
DET_COLOR = (0, 0, 255)  # BGR red


def display_image(image01) -> np.ndarray:
    """uint8 grey image of a float image in [0, 1] (values outside clipped): what
    ``draw_overlay`` draws on; 4x smaller than the float image it comes from."""
    img = np.asarray(image01, dtype=np.float32)
    return (np.clip(np.nan_to_num(img), 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def draw_overlay(image01, gt_boxes=(), det_boxes=(), det_scores=None, out_png=None,
                 max_side=None):
    """Return (and with `out_png`, write) a BGR uint8 overlay.

    image01: HxW float image in [0, 1] (values outside are clipped) or a uint8 grey image
    (``display_image``); boxes XYXY in the image's pixels. `max_side` downsizes the result
    (boxes scaled along) so full-field mammograms give manageable PNGs; line width and font
    scale follow the output size.
    """
    img = np.asarray(image01)
    if img.dtype != np.uint8:
        img = img.astype(np.float32, copy=False)
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
    u8 = img if img.dtype == np.uint8 else display_image(img)
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


def exam_montage(overlays, height):
    """An exam's overlays (BGR, in the order given) resized to ``height`` and side by side."""
    return np.hstack([cv2.resize(bgr, (max(1, round(bgr.shape[1] * height / bgr.shape[0])),
                                       height), interpolation=cv2.INTER_AREA)
                      for bgr in overlays])


def load_predictions(path):
    """{image key (str): (boxes (N, 4) XYXY original px, scores (N,))}."""
    with open(path) as f:
        data = json.load(f)
    out = defaultdict(lambda: ([], []))
    if isinstance(data, dict) and "images" in data:  # tools/predict.py
        for rec in data["images"]:
            key = str(rec.get("sop_instance_uid", rec.get("image_id")))
            for d in rec.get("detections", []):
                out[key][0].append(d["box_xyxy"])
                out[key][1].append(d["score"])
    elif isinstance(data, list):  # COCO results
        id_map = {}
        gt_path = os.path.join(os.path.dirname(os.path.abspath(path)), "gt_coco.json")
        if os.path.exists(gt_path):
            with open(gt_path) as f:
                id_map = {im["id"]: str(im.get("braixdet_image_id", im.get("file_name")))
                          for im in json.load(f)["images"]}
        for d in data:
            key = str(d.get("braixdet_image_id", id_map.get(d["image_id"], d["image_id"])))
            x, y, w, h = d["bbox"]
            out[key][0].append([x, y, x + w, y + h])
            out[key][1].append(d["score"])
    else:
        raise ValueError(f"{path}: unknown predictions format")
    return {k: (np.asarray(b, dtype=np.float64).reshape(-1, 4), np.asarray(s, dtype=np.float64))
            for k, (b, s) in out.items()}


def _gt_boxes(record):
    boxes = [BoxMode.convert(list(a["bbox"]), a.get("bbox_mode", BoxMode.XYXY_ABS),
                             BoxMode.XYXY_ABS) for a in record.get("annotations", [])]
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4)


def load_image(file_name, laterality=None, canonical_params=None):
    """(image01, box mapping fn): original image with identity, or canonical with its transform."""
    img, meta = read_dicom_image(file_name)
    if canonical_params is None:
        return img, (lambda b: b), meta
    canon, tfm, _ = canonicalize(img, laterality or meta.laterality, canonical_params)
    return canon, (lambda b: tfm.apply_box(b) if len(b) else b), meta


def render(items, out_dir, score_thresh=0.0, canonical_params=None, max_images=None,
           max_side=2048):
    """items: iterable of (key, file_name, laterality, gt_boxes, (boxes, scores)); returns paths."""
    written = []
    for key, file_name, laterality, gt, (boxes, scores) in items:
        if max_images is not None and len(written) >= max_images:
            break
        keep = scores >= score_thresh
        img, to_img, _ = load_image(file_name, laterality, canonical_params)
        path = safe_output_path(out_dir, key, ".png")
        draw_overlay(img, to_img(gt), to_img(boxes[keep]), scores[keep], path, max_side=max_side)
        written.append(path)
    return written


def dataset_items(dataset, preds, only_with_lesions=False):
    """render() items of a registered dataset: (image id, file, laterality, GT, predictions)."""
    items = []
    for d in DatasetCatalog.get(dataset):
        gt = _gt_boxes(d)
        if only_with_lesions and len(gt) == 0:
            continue
        key = str(d["image_id"])
        items.append((key, d["file_name"], d.get("laterality"), gt, preds.get(key, EMPTY)))
    return items


def dicom_items(dicom, preds, key=None, predictions_path=""):
    """render() items of one DICOM; its predictions by ``key``, else by SOP Instance UID, else
    the only image of ``preds``."""
    if key is None:
        meta = read_dicom_meta(dicom)
        key = meta.sop_uid if meta.sop_uid in preds or len(preds) != 1 else next(iter(preds))
    if preds and key not in preds:
        logger.warning("no predictions for %s in %s", key, predictions_path)
    return [(key, dicom, None, np.zeros((0, 4)), preds.get(key, EMPTY))]
