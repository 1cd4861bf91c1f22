"""What ``tools/predict.py`` writes: predictions.json, report.json, overlays and DICOM SRs.

``predict_to_folder`` runs an ``ExamPredictor`` over DICOM files / folders and writes into one
output folder (one run per folder: ``acquire_output_lock``):

* ``predictions.json`` (``--format json|both``): {"images": [per input file: record_id (the
  SOPInstanceUID, ``_dup<n>`` for a repeated UID), sop_instance_uid, exam (index), laterality,
  view, aux_missing, height, width, detections [{box_xyxy (original pixels), score}]],
  "exams": [{exam, key (pseudonym), score, breasts {"L"/"R": score}, records}], "report":
  counts}. Scores: ``evaluation/exam_scores.py`` (max detection score). No patient identifier,
  no path.
* ``sr/exam_<k>.dcm`` (``--format sr|both``): one TID 1500 Comprehensive SR per exam, and
  ``pr/<record_id>.dcm``, a Grayscale Softcopy Presentation State per image that viewers draw
  (``evaluation/sr.py``); the only outputs with the patient / study identity of the images
  (``sr_pseudonymise``: a pseudonymised patient module instead).
* ``<record_id>.png`` overlays (boxes >= ``overlay_thresh`` on the original image) and
  ``exams/exam_<k>.png``, the exam's views side by side (R CC, R MLO, L CC, L MLO; our choice).
* ``report.json``: one line per bad input, the counts.

A refused output file (a planted symlink) or an unreadable image at overlay time is one
bad-input line; the run goes on. Default ``formats`` = json (our choice: the SR is opt-in,
since it carries patient identity and highdicom builds ~100 findings/s, slow at low thresholds).
"""
import io
import logging
import os

import cv2
import numpy as np
import pydicom
from pydicom.errors import InvalidDicomError

from ..data.dicom import read_dicom_image
from ..data.report import BadInputError, BadInputReport
from ..evaluation.exam_scores import breast_exam_scores, image_score
from ..evaluation.overlay import draw_overlay
from ..evaluation.sr import exam_sr, image_presentation_state
from ..utils import safe_output_path
from ..utils.io import OutputPathRefused, atomic_write_bytes, atomic_write_json
from .output_lock import acquire_output_lock
from .predictor import ExamPredictor

__all__ = ["FORMATS", "detections_record", "predict_to_folder"]

logger = logging.getLogger(__name__)

FORMATS = {"json": ("json",), "sr": ("sr",), "both": ("json", "sr")}
_MONTAGE_HEIGHT = 1024  # px of the exam overlay (our choice: readable, small PNG)


def detections_record(pred, score_thresh):
    """predictions.json entry of one ``ImagePrediction`` (no identifiers, no paths)."""
    keep = pred.scores >= score_thresh
    meta, (h, w) = pred.meta, pred.instances.image_size
    return {"record_id": pred.record_id or meta.sop_uid, "sop_instance_uid": meta.sop_uid,
            "laterality": meta.laterality, "view": meta.view,
            "aux_missing": pred.aux_missing, "height": int(h), "width": int(w),
            "detections": [{"box_xyxy": [round(v, 1) for v in b], "score": round(s, 5)}
                           for b, s in zip(pred.boxes[keep].tolist(),
                                           pred.scores[keep].tolist())]}


def _write_png(out_dir, name, image):
    ok, png = cv2.imencode(".png", image)
    if not ok:
        raise OSError(f"could not encode {name}.png")
    atomic_write_bytes(safe_output_path(out_dir, name, ".png"), png.tobytes(), fsync=False)


def _overlays(preds, exam_no, out_dir, thresh, allow_for_processing, report):
    """Per-image overlays and the exam montage; a failed image is one report line."""
    tiles = []
    order = {("R", "CC"): 0, ("R", "MLO"): 1, ("L", "CC"): 2, ("L", "MLO"): 3}
    for pred in sorted(preds, key=lambda p: (order.get((p.meta.laterality, p.meta.view), 9),
                                             p.record_id)):
        try:
            # decoded again: display only, not model input
            image, _ = read_dicom_image(pred.meta.path, allow_for_processing=allow_for_processing)
            keep = pred.scores >= thresh
            bgr = draw_overlay(image, [], pred.boxes[keep], pred.scores[keep])
            _write_png(out_dir, pred.record_id, bgr)
        except BadInputError as e:  # e.g. the file vanished after prediction
            report.add(e)
            continue
        except OutputPathRefused as e:  # a planted symlink: this file only
            report.add(BadInputError(e.path, "refused_output", e.reason))
            continue
        scale = _MONTAGE_HEIGHT / bgr.shape[0]
        tiles.append(cv2.resize(bgr, (max(1, round(bgr.shape[1] * scale)), _MONTAGE_HEIGHT),
                                interpolation=cv2.INTER_AREA))
    if tiles:
        try:
            os.makedirs(os.path.join(out_dir, "exams"), exist_ok=True)
            _write_png(os.path.join(out_dir, "exams"), f"exam_{exam_no}", np.hstack(tiles))
        except OutputPathRefused as e:
            report.add(BadInputError(e.path, "refused_output", e.reason))


def _write_dicom(folder, name, ds, report):
    try:
        os.makedirs(folder, exist_ok=True)
        buf = io.BytesIO()
        pydicom.dcmwrite(buf, ds, enforce_file_format=True)
        atomic_write_bytes(safe_output_path(folder, name, ".dcm"), buf.getvalue())
    except OutputPathRefused as e:
        report.add(BadInputError(e.path, "refused_output", e.reason))


def _write_sr(preds, breasts, exam_score, exam_no, out_dir, score_thresh, pseudonymise, report):
    images = [{"path": p.meta.path, "laterality": p.meta.laterality, "boxes": p.boxes,
               "scores": p.scores} for p in preds]
    try:  # the headers are read again: a file changed since prediction is one report line
        sr = exam_sr(images, breasts, exam_score, score_thresh=score_thresh,
                     pseudonymise_patient=pseudonymise)
        prs = [(p.record_id, image_presentation_state(
            p.meta.path, p.boxes, p.scores, score_thresh=score_thresh,
            pseudonymise_patient=pseudonymise)) for p in preds]
    except (OSError, ValueError, InvalidDicomError) as e:
        report.add(BadInputError(preds[0].meta.path, "sr_failed", f"exam {exam_no}: {e}"[:200]))
        return
    _write_dicom(os.path.join(out_dir, "sr"), f"exam_{exam_no}", sr, report)
    for record_id, pr in prs:
        _write_dicom(os.path.join(out_dir, "pr"), record_id, pr, report)


def predict_to_folder(cfg, weights, inputs, out_dir, *, formats="json", score_thresh=0.05,
                      overlay_thresh=0.3, overlays=True, share_features=True, num_workers=2,
                      views_csv=None, sr_pseudonymise=False):
    """Predict ``inputs`` and write the outputs above into ``out_dir``; returns the
    predictions.json dict (also when the JSON format is off)."""
    if formats not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {formats!r}")
    os.makedirs(out_dir, exist_ok=True)
    lock = acquire_output_lock(out_dir, tool="predict")  # one run per output folder
    try:
        return _predict(cfg, weights, inputs, out_dir, FORMATS[formats], score_thresh,
                        overlay_thresh, overlays, share_features, num_workers, views_csv,
                        sr_pseudonymise)
    finally:
        lock.release()


def _predict(cfg, weights, inputs, out_dir, formats, score_thresh, overlay_thresh, overlays,
             share_features, num_workers, views_csv, sr_pseudonymise):
    from ..data.views import load_views_csv

    report = BadInputReport("predict")
    allow_fp = cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING
    overrides = load_views_csv(views_csv, report) if views_csv else None
    records, exams_out = [], []
    with ExamPredictor(cfg, weights, share_features=share_features,
                       num_workers=num_workers) as predictor:
        exams = predictor.exams(inputs, report, overrides=overrides)
        for exam_no, (exam, preds) in enumerate(predictor.predict_exams(exams, report)):
            if not preds:
                continue
            breasts, exam_scores = breast_exam_scores(
                (exam_no, p.meta.laterality, image_score(p.scores)) for p in preds)
            breast_scores = {lat: s for (_, lat), s in breasts.items()}
            exams_out.append({"exam": exam_no, "key": exam.key,
                              "score": round(exam_scores[exam_no], 5),
                              "breasts": {k: round(v, 5) for k, v in breast_scores.items()},
                              "records": [p.record_id for p in preds]})
            for pred in preds:
                records.append({**detections_record(pred, score_thresh), "exam": exam_no})
            if overlays:
                _overlays(preds, exam_no, out_dir, overlay_thresh, allow_fp, report)
            if "sr" in formats:
                _write_sr(preds, breast_scores, exam_scores[exam_no], exam_no, out_dir,
                          score_thresh, sr_pseudonymise, report)
    result = {"images": records, "exams": exams_out, "report": report.to_dict()["counts"]}
    if "json" in formats:
        atomic_write_json(os.path.join(out_dir, "predictions.json"), result, indent=1)
    report.save(os.path.join(out_dir, "report.json"))
    logger.info(report.summary())
    logger.info(f"{len(records)} image predictions in {len(exams_out)} exams, {out_dir}")
    return result
