"""Overlays of ground truth (blue) and detections (red, with scores) as PNGs (tools/visualize.py).

Predictions: COCO results (detections_coco.json: image_id, bbox xywh, score; image ids mapped
back through "braixdet_image_id" or the gt_coco.json next to it) or tools/predict.py's
predictions.json. Boxes are in original DICOM pixels; with canonical preprocessing parameters
they are drawn on the canonical image, mapped with the preprocessing transform.
"""
import json
import logging
import os
from collections import defaultdict

import numpy as np

from ..utils import safe_output_path
from .overlay import draw_overlay

logger = logging.getLogger(__name__)
EMPTY = (np.zeros((0, 4)), np.zeros(0))


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
    from detectron2.structures import BoxMode

    boxes = [BoxMode.convert(list(a["bbox"]), a.get("bbox_mode", BoxMode.XYXY_ABS),
                             BoxMode.XYXY_ABS) for a in record.get("annotations", [])]
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4)


def load_image(file_name, laterality=None, canonical_params=None):
    """(image01, box mapping fn): original image with identity, or canonical with its transform."""
    from ..data.dicom import read_dicom_image  # lazy: heavy imports, optional tool

    img, meta = read_dicom_image(file_name)
    if canonical_params is None:
        return img, (lambda b: b), meta
    from ..data.preprocess import canonicalize

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
    from detectron2.data import DatasetCatalog

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
    from ..data.dicom import read_dicom_meta

    if key is None:
        meta = read_dicom_meta(dicom)
        key = meta.sop_uid if meta.sop_uid in preds or len(preds) != 1 else next(iter(preds))
    if preds and key not in preds:
        logger.warning("no predictions for %s in %s", key, predictions_path)
    return [(key, dicom, None, np.zeros((0, 4)), preds.get(key, EMPTY))]
