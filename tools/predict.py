#!/usr/bin/env python
"""Detect malignant lesions in DICOM mammograms: files or folders in, boxes in original pixels out.

  python tools/predict.py --config-file configs/BRAIxDet/braixdet.yaml \
      --weights output/braixdet/model_export.pth --input /exams/ --out predictions/

A thin CLI over ``braixdet.inference.predict_to_folder`` (``ExamPredictor``: exam
grouping, CC/MLO pairing, the training pixel path, one encoding per image per exam). Writes
``predictions.json`` (per image: boxes in original DICOM pixels and scores; per breast and
exam: malignancy scores; no patient identifiers or paths), with ``--format sr|both`` one DICOM
SR per exam under ``sr/`` (TID 1500) and a presentation state per image under ``pr/`` (they carry
the images' patient/study identity unless ``--sr-pseudonymise MAPPING.json``), ``report.json``
(bad or unpaired inputs; paths relative to ``--input``) and overlay PNGs (per image, and per exam
under ``exams/``). A file of the previous run in ``--out`` (its manifest) is removed first.
"""
import argparse
import sys

from detectron2.utils.logger import setup_logger

from braixdet.cli import run_tool
from braixdet.config import build_cfg
from braixdet.inference import FORMATS, predict_to_folder


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", required=True, help="model_export.pth or a stage-2 checkpoint")
    ap.add_argument("--input", nargs="+", required=True, help="DICOM files or folders")
    ap.add_argument("--out", required=True)
    ap.add_argument("--format", choices=sorted(FORMATS), default="json",
                    help="predictions.json (default), DICOM SR + presentation states, or both")
    ap.add_argument("--sr-pseudonymise", metavar="MAPPING.json", default=None,
                    help="research: de-identified SRs and presentation states (PS3.15 Basic "
                         "Profile, random pseudonyms and UIDs); the mapping file (created when "
                         "absent, kept outside --out) is the only link back to the patients")
    ap.add_argument("--views-csv", default=None,
                    help="CSV file -> laterality, view, exam for archives without such tags")
    ap.add_argument("--score-thresh", type=float, default=0.05, help="kept in the JSON / SR")
    ap.add_argument("--overlay-thresh", type=float, default=0.3, help="drawn on the PNGs")
    ap.add_argument("--no-overlays", action="store_true")
    ap.add_argument("--no-share-features", action="store_true")
    ap.add_argument("--workers", type=int, default=2,
                    help="DataLoader processes decoding ahead of the model (0: serial)")
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    setup_logger(name="braixdet")
    cfg = build_cfg(args.config_file, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", *args.opts])
    cfg.freeze()
    result = predict_to_folder(
        cfg, args.weights, args.input, args.out, formats=args.format,
        score_thresh=args.score_thresh, overlay_thresh=args.overlay_thresh,
        overlays=not args.no_overlays, share_features=not args.no_share_features,
        num_workers=args.workers, views_csv=args.views_csv,
        sr_pseudonym_map=args.sr_pseudonymise)
    print(f"wrote {len(result['images'])} image predictions in {len(result['exams'])} exams "
          f"to {args.out}")
    return result["images"]


if __name__ == "__main__":
    sys.exit(run_tool(main))  # a refusal (busy --out, crafted checkpoint) is one error line
