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
import logging
import sys

from braixdet.cli import run_tool
from braixdet.config import build_cfg, register_datasets
from braixdet.data.preprocess import PreprocessParams
from braixdet.inference.visualize import dataset_items, dicom_items, load_predictions, render


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
    params = cfg = None
    if args.config_file or args.dataset:
        cfg = build_cfg(args.config_file, args.opts)
        if args.dataset:
            register_datasets(cfg)
    if args.canonical:
        params = PreprocessParams.from_cfg(cfg) if cfg is not None else PreprocessParams()
    if args.dataset:
        items = dataset_items(args.dataset, preds, args.only_with_lesions)
    else:
        items = dicom_items(args.dicom, preds, args.image_id, args.predictions)
    written = render(items, args.out, args.score_thresh, params, args.max_images, args.max_side)
    print(f"wrote {len(written)} PNG(s) to {args.out}", file=sys.stderr)
    return written


if __name__ == "__main__":
    sys.exit(run_tool(main))
