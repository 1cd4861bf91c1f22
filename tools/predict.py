#!/usr/bin/env python
"""Detect malignant lesions in DICOM mammograms: files or folders in, boxes in original pixels out.

  python tools/predict.py --config-file configs/BRAIxDet/braixdet.yaml \
      --weights output/braixdet/model_final_teacher.pth --input /exams/ --out predictions/

A thin CLI over ``braixdet.engine.ExamPredictor`` (exam grouping, CC/MLO pairing, the training
pixel path, one encoding per image per exam; ``--no-share-features`` recomputes per pair).
Writes ``predictions.json`` (SOPInstanceUID, laterality, view, boxes in original DICOM pixel
coordinates, scores; no patient identifiers or paths), ``report.json`` (unreadable or unpaired
images) and overlay PNGs named by SOPInstanceUID (sanitised: a crafted UID cannot write outside
--out). Canonical images go to INPUT.BRAIXDET.CACHE_DIR when set, else to a temporary folder
deleted at the end.
"""
import argparse
import logging
import os
import sys

from detectron2.utils.logger import setup_logger
from tqdm import tqdm

from braixdet.data.dicom import read_dicom_image
from braixdet.data.report import BadInputError, BadInputReport
from braixdet.engine import ExamPredictor
from braixdet.engine.output_lock import acquire_output_lock
from braixdet.engine.preflight import run_tool
from braixdet.engine.setup import build_cfg
from braixdet.utils import safe_output_path
from braixdet.utils.io import OutputPathRefused, atomic_write_json

logger = logging.getLogger("braixdet.predict")


def detections_record(pred, score_thresh):
    """predictions.json entry of one ``ImagePrediction`` (no identifiers, no paths)."""
    keep = pred.scores >= score_thresh
    meta, (h, w) = pred.meta, pred.instances.image_size
    return {"sop_instance_uid": meta.sop_uid, "laterality": meta.laterality,
            "view": meta.view, "aux_missing": pred.aux_missing, "height": int(h),
            "width": int(w),
            "detections": [{"box_xyxy": [round(v, 1) for v in b], "score": round(s, 5)}
                           for b, s in zip(pred.boxes[keep].tolist(),
                                           pred.scores[keep].tolist())]}


def write_overlay(pred, out_dir, thresh, allow_for_processing):
    """Detections drawn on the original image (decoded again: display only, not model input)."""
    from braixdet.evaluation.overlay import draw_overlay

    image, _ = read_dicom_image(pred.meta.path, allow_for_processing=allow_for_processing)
    keep = pred.scores >= thresh
    draw_overlay(image, [], pred.boxes[keep], pred.scores[keep],
                 safe_output_path(out_dir, pred.meta.sop_uid, ".png"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", required=True, help="teacher export or stage-2 checkpoint")
    ap.add_argument("--input", nargs="+", required=True, help="DICOM files or folders")
    ap.add_argument("--out", required=True)
    ap.add_argument("--score-thresh", type=float, default=0.05, help="kept in the JSON")
    ap.add_argument("--overlay-thresh", type=float, default=0.3, help="drawn on the PNGs")
    ap.add_argument("--no-overlays", action="store_true")
    ap.add_argument("--no-share-features", action="store_true")
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    setup_logger(name="braixdet")
    cfg = build_cfg(args.config_file, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", *args.opts])
    cfg.freeze()
    os.makedirs(args.out, exist_ok=True)
    lock = acquire_output_lock(args.out, tool="predict")  # one run per --out folder
    try:
        return _predict(args, cfg)
    finally:
        lock.release()


def _predict(args, cfg):
    report = BadInputReport("predict")
    allow_fp = cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING
    records = []
    with ExamPredictor(cfg, args.weights, share_features=not args.no_share_features) as predictor:
        exams = predictor.exams(args.input, report)
        for exam_no, exam in enumerate(tqdm(exams, desc="exams", unit="exam")):
            for pred in predictor.predict_exam(exam, report):
                rec = detections_record(pred, args.score_thresh)
                rec["exam"] = exam_no
                records.append(rec)
                if not args.no_overlays:
                    try:
                        write_overlay(pred, args.out, args.overlay_thresh, allow_fp)
                    except BadInputError as e:  # e.g. the file vanished after prediction
                        report.add(e)
                    except OutputPathRefused as e:  # a planted symlink: this file only
                        report.add(BadInputError(e.path, "refused_output", e.reason))
    atomic_write_json(os.path.join(args.out, "predictions.json"),
                      {"images": records, "report": report.to_dict()["counts"]}, indent=1)
    report.save(os.path.join(args.out, "report.json"))
    print(report.summary())
    print(f"wrote {len(records)} image predictions to {args.out}/predictions.json")
    return records


if __name__ == "__main__":
    sys.exit(run_tool(main))  # a refusal (busy --out, crafted checkpoint) is one error line
