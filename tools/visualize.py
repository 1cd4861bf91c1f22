#!/usr/bin/env python
"""Draw ground truth (blue) and detections (red, with scores) as PNGs.

  # images of a registered dataset (registered from the config), evaluator output
  python tools/visualize.py --config-file configs/BRAIxDet/braixdet.yaml --dataset cbis_ddsm_test \\
      --predictions out/run/inference/cbis_ddsm_test/detections_coco.json --out vis/
  # one DICOM with tools/predict.py's predictions.json (matched by SOPInstanceUID)
  python tools/visualize.py --dicom exam/img.dcm --predictions pred/predictions.json --out vis/

Predictions: COCO results (detections_coco.json: image_id, bbox xywh, score; image ids mapped
back through "braixdet_image_id" or the gt_coco.json next to it) or predict.py's predictions.json.
Boxes are in original DICOM pixels; `--canonical` draws on the canonical (cropped, flipped,
resized) image instead, mapping the boxes with the preprocessing transform.
"""
import argparse
import json
import logging
import os
import sys
from collections import defaultdict

import numpy as np

from braixdet.evaluation.overlay import draw_overlay
from braixdet.utils import safe_output_path

logger = logging.getLogger("braixdet.visualize")


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
    from braixdet.data.dicom import read_dicom_image  # lazy: heavy imports, optional tool

    img, meta = read_dicom_image(file_name)
    if canonical_params is None:
        return img, (lambda b: b), meta
    from braixdet.data.preprocess import canonicalize

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="registered dataset name (with --config-file)")
    src.add_argument("--dicom", help="one DICOM file")
    ap.add_argument("--config-file", default="", help="registers the datasets it names")
    ap.add_argument("--predictions", help="detections_coco.json or predict.py predictions.json")
    ap.add_argument("--image-id", help="--dicom: key of its predictions (default: SOP UID, or "
                                       "the only image of the file)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-images", type=int, default=50)
    ap.add_argument("--score-thresh", type=float, default=0.3)
    ap.add_argument("--canonical", action="store_true", help="draw on the canonical image")
    ap.add_argument("--only-with-lesions", action="store_true",
                    help="--dataset: skip images without GT boxes")
    ap.add_argument("--max-side", type=int, default=2048, help="PNG size limit (px)")
    ap.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides KEY VALUE ...")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)

    preds = load_predictions(args.predictions) if args.predictions else {}
    empty = (np.zeros((0, 4)), np.zeros(0))
    params = None
    cfg = None
    if args.config_file or args.dataset:
        from braixdet.engine.setup import build_cfg, register_and_assign_datasets

        cfg = build_cfg(args.config_file, args.opts)
        if args.dataset:
            register_and_assign_datasets(cfg)
    if args.canonical:
        from braixdet.data.preprocess import PreprocessParams

        params = PreprocessParams.from_cfg(cfg) if cfg is not None else PreprocessParams()

    if args.dataset:
        from detectron2.data import DatasetCatalog

        items = []
        for d in DatasetCatalog.get(args.dataset):
            gt = _gt_boxes(d)
            if args.only_with_lesions and len(gt) == 0:
                continue
            key = str(d["image_id"])
            items.append((key, d["file_name"], d.get("laterality"), gt, preds.get(key, empty)))
    else:
        from braixdet.data.dicom import read_dicom_meta

        key = args.image_id
        if key is None:
            meta = read_dicom_meta(args.dicom)
            key = meta.sop_uid if meta.sop_uid in preds or len(preds) != 1 else next(iter(preds))
        if preds and key not in preds:
            logger.warning("no predictions for %s in %s", key, args.predictions)
        items = [(key, args.dicom, None, np.zeros((0, 4)), preds.get(key, empty))]

    written = render(items, args.out, args.score_thresh, params, args.max_images, args.max_side)
    print(f"wrote {len(written)} PNG(s) to {args.out}", file=sys.stderr)
    return written


if __name__ == "__main__":
    main()
