"""What ``tools/predict.py`` writes: predictions.json, report.json, overlays and DICOM SRs.

``predict_to_folder`` runs an ``ExamPredictor`` over DICOM files / folders and writes into one
output folder (one run per folder: ``acquire_output_lock``):

* ``predictions.json`` (``--format json|both``): {"images": [per input file: record_id (the
  SOPInstanceUID, ``_dup<n>`` for a repeated UID), sop_instance_uid, exam (index), laterality,
  view, aux_missing, height, width, detections [{box_xyxy (original pixels), score}]],
  "exams": [{exam, key (a pseudonym valid in this run only), score, breasts {"L"/"R": score},
  records}], "report":
  counts}. Scores: ``evaluation/exam_scores.py`` (max detection score). No patient identifier,
  no path.
* ``sr/exam_<k>.dcm`` (``--format sr|both``): one TID 1500 Comprehensive SR per exam, and
  ``pr/<record_id>.dcm``, a Grayscale Softcopy Presentation State per image that viewers draw
  (``inference/sr.py``); the only outputs with the patient / study identity of the images
  (``sr_pseudonym_map``: de-identified with the user's mapping file, ``inference/deidentify.py``).
  A source file that cannot be read again when they are written is one ``sr_source_missing``
  line naming it; the SR and presentation states of the exam's other images are still written.
* ``<record_id>.png`` overlays (boxes >= ``overlay_thresh`` on the original image, from the
  decode that made the model's pixels: ``ExamPredictor(keep_images=True)``) and
  ``exams/exam_<k>.png``, the exam's views side by side (R CC, R MLO, L CC, L MLO; our choice).
* ``report.json``: one line per bad input, the counts. Its paths are relative to the ``--input``
  they were found under (an input's own folder names, e.g. a medical record number, stay out).
* ``.braixdet-outputs``: the manifest, one output path per line. A new run into the same folder
  first removes the files the previous manifest lists (they would otherwise sit beside a
  ``predictions.json`` that does not list them); it never touches other files.

Refused before anything is predicted (one line): ``sr/``, ``pr/`` or ``exams/`` being a symbolic
link (the outputs would land outside the folder). A refused output file (a planted symlink) is
one bad-input line; the run goes on. Library warnings
(pydicom, highdicom) quote header values, so during a run they are counted and logged without
their text. SIGTERM ends the run like Ctrl-C: the temporary cache of canonical images is
deleted. Default ``formats`` = json (our choice: the SR is opt-in, since it carries patient
identity and highdicom builds ~100 findings/s, slow at low thresholds).
"""
import contextlib
import hmac
import io
import logging
import os
import secrets
import signal
import threading
import warnings

import cv2
import pydicom
from pydicom.errors import InvalidDicomError

from ..data.report import BadInputError, BadInputReport
from ..data.views import load_views_csv
from ..evaluation.exam_scores import breast_exam_scores, image_score
from ..utils import safe_output_path
from ..utils.io import (
    OutputPathRefused,
    atomic_write_bytes,
    atomic_write_json,
    open_no_follow,
    refuse_link,
)
from ..utils.output_lock import acquire_output_lock
from .deidentify import PseudonymMap
from .predictor import ExamPredictor
from .sr import exam_sr, image_presentation_state, read_source_header
from .visualize import draw_overlay, exam_montage

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


SUBFOLDERS = ("sr", "pr", "exams")
MANIFEST = ".braixdet-outputs"


class _Outputs:
    """The files of this run in ``out_dir``, listed in its manifest as they are written; the
    previous run's files are removed first (module doc)."""

    def __init__(self, out_dir):
        self.root = os.path.realpath(out_dir)
        for sub in SUBFOLDERS:  # refused up front: nothing predicted, nothing written
            refuse_link(os.path.join(self.root, sub))
        self.manifest = os.path.join(self.root, MANIFEST)
        refuse_link(self.manifest)
        self.removed = self._remove_previous()
        self._file = open_no_follow(self.manifest, "w")

    def _remove_previous(self):
        if not os.path.isfile(self.manifest):
            return 0
        with open(self.manifest, encoding="utf-8", errors="replace") as f:
            names = [line.rstrip("\n") for line in f if line.strip()]
        n = 0
        for rel in names:
            path = os.path.normpath(os.path.join(self.root, rel))
            # only our own plain files inside the folder; a link or a path out is left alone
            if (os.path.dirname(path) in {self.root, *(os.path.join(self.root, s)
                                                      for s in SUBFOLDERS)}
                    and not os.path.islink(path) and os.path.isfile(path)
                    and not os.path.islink(os.path.dirname(path))):
                os.unlink(path)
                n += 1
        return n

    def close(self):
        self._file.close()

    def folder(self, sub=""):
        path = os.path.join(self.root, sub) if sub else self.root
        refuse_link(path)  # planted after the start: refused, as any link we would write into
        os.makedirs(path, exist_ok=True)
        return path

    def write(self, sub, name, suffix, data: bytes, fsync=True):
        path = safe_output_path(self.folder(sub), name, suffix)
        self._file.write(os.path.relpath(path, self.root) + "\n")
        self._file.flush()  # listed before it exists: a killed run's files are still listed
        atomic_write_bytes(path, data, fsync=fsync)

    def write_json(self, name, obj):
        path = os.path.join(self.root, name)
        self._file.write(name + "\n")
        self._file.flush()
        atomic_write_json(path, obj, indent=1)


class _InputRelativeReport(BadInputReport):
    """A ``BadInputReport`` whose paths are relative to the ``--input`` they were found under
    (an input's own path can hold an identifier, e.g. ``/exams/MRN123/``), or to ``--out``."""

    def __init__(self, name, inputs, out_dir):
        super().__init__(name)
        roots = [os.path.abspath(os.fspath(p)) for p in inputs]
        self._roots = [(r if os.path.isdir(r) else os.path.dirname(r)) for r in roots]
        self._roots.append(os.path.realpath(out_dir))

    def relative(self, path):
        path = os.path.abspath(path)
        for root in sorted(self._roots, key=len, reverse=True):
            if path == root or path.startswith(root.rstrip(os.sep) + os.sep):
                return os.path.relpath(path, root)
        return os.path.basename(path)

    def add(self, err: BadInputError):
        rel = self.relative(err.path)
        detail = err.detail.replace(os.path.abspath(err.path), rel).replace(err.path, rel)
        super().add(BadInputError(rel, err.reason, detail))


@contextlib.contextmanager
def _library_warnings_counted():
    """pydicom / highdicom warnings quote header values (a PatientID with ``../``): shown as a
    count at the end instead of their text. Other warnings pass unchanged."""
    count = [0]
    with warnings.catch_warnings():
        show = warnings.showwarning

        def quiet(message, category, filename, lineno, file=None, line=None):
            if f"{os.sep}pydicom{os.sep}" in filename or f"{os.sep}highdicom{os.sep}" in filename:
                count[0] += 1
            else:
                show(message, category, filename, lineno, file, line)
        warnings.showwarning = quiet
        try:
            yield
        finally:
            if count[0]:
                logger.warning("%d pydicom/highdicom warnings about header values not shown "
                               "(they can quote patient identifiers)", count[0])


@contextlib.contextmanager
def _sigterm_exits():
    """SIGTERM raises SystemExit (as Ctrl-C raises KeyboardInterrupt), so the ``with`` blocks
    run: the predictor deletes its temporary cache of canonical patient images."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _png(name, image):
    ok, png = cv2.imencode(".png", image)
    if not ok:
        raise OSError(f"could not encode {name}.png")
    return png.tobytes()


def _overlays(preds, exam_no, outputs, thresh, report):
    """Per-image overlays and the exam montage, on the images the predictor kept; a refused
    output file is one report line."""
    tiles = []
    order = {("R", "CC"): 0, ("R", "MLO"): 1, ("L", "CC"): 2, ("L", "MLO"): 3}
    for pred in sorted(preds, key=lambda p: (order.get((p.meta.laterality, p.meta.view), 9),
                                             p.record_id)):
        keep = pred.scores >= thresh
        bgr = draw_overlay(pred.image, [], pred.boxes[keep], pred.scores[keep])
        try:
            outputs.write("", pred.record_id, ".png", _png(pred.record_id, bgr), fsync=False)
        except OutputPathRefused as e:  # a planted symlink: this file only
            report.add(BadInputError(e.path, "refused_output", e.reason))
            continue
        tiles.append(bgr)
    if tiles:
        try:
            outputs.write("exams", f"exam_{exam_no}", ".png",
                          _png(f"exam_{exam_no}", exam_montage(tiles, _MONTAGE_HEIGHT)),
                          fsync=False)
        except OutputPathRefused as e:
            report.add(BadInputError(e.path, "refused_output", e.reason))


def _write_dicom(outputs, sub, name, ds, report):
    try:
        buf = io.BytesIO()
        pydicom.dcmwrite(buf, ds, enforce_file_format=True)
        outputs.write(sub, name, ".dcm", buf.getvalue())
    except OutputPathRefused as e:
        report.add(BadInputError(e.path, "refused_output", e.reason))


def _write_sr(preds, breasts, exam_score, exam_no, outputs, score_thresh, pseudonyms, report):
    """The exam's SR and presentation states from the headers that can still be read; a
    file gone or changed since prediction is one ``sr_source_missing`` line naming it."""
    raw = {}
    for p in preds:  # the headers are read again: the writers copy the source identity
        try:
            raw[p.record_id] = read_source_header(p.meta.path)
        except (OSError, ValueError, InvalidDicomError) as e:
            report.add(BadInputError(p.meta.path, "sr_source_missing", f"exam {exam_no}: not in "
                                     f"its SR, no presentation state ({type(e).__name__})"))
    readable = [p for p in preds if p.record_id in raw]
    if not readable:
        return
    first = raw[readable[0].record_id]
    headers = {k: pseudonyms.header(ds, first) if pseudonyms is not None else ds
               for k, ds in raw.items()}
    if pseudonyms is not None:
        pseudonyms.save()  # the mapping is on disk before any output that uses it
    try:
        sr = exam_sr([{"header": headers[p.record_id], "laterality": p.meta.laterality,
                       "boxes": p.boxes, "scores": p.scores} for p in readable], breasts,
                     exam_score, score_thresh=score_thresh, pseudonyms=pseudonyms)
    except ValueError as e:  # highdicom refuses the headers (e.g. two studies' patients)
        report.add(BadInputError(readable[0].meta.path, "sr_failed", f"exam {exam_no}: {e}"[:200]))
    else:
        _write_dicom(outputs, "sr", f"exam_{exam_no}", sr, report)
    for p in readable:
        try:
            pr = image_presentation_state(
                p.meta.path, p.boxes, p.scores, score_thresh=score_thresh,
                laterality=p.meta.laterality, header=headers[p.record_id], pseudonyms=pseudonyms)
        except ValueError as e:
            report.add(BadInputError(p.meta.path, "sr_failed", f"exam {exam_no}: {e}"[:200]))
            continue
        _write_dicom(outputs, "pr", p.record_id, pr, report)


def predict_to_folder(cfg, weights, inputs, out_dir, *, formats="json", score_thresh=0.05,
                      overlay_thresh=0.3, overlays=True, share_features=True, num_workers=2,
                      views_csv=None, sr_pseudonym_map=None):
    """Predict ``inputs`` and write the outputs above into ``out_dir``; returns the
    predictions.json dict (also when the JSON format is off). ``sr_pseudonym_map``: the user's
    mapping file (created when absent, outside ``out_dir``): de-identified SRs and
    presentation states (``inference/deidentify.py``)."""
    if formats not in FORMATS:
        raise ValueError(f"format must be one of {sorted(FORMATS)}, got {formats!r}")
    if sr_pseudonym_map is not None and "sr" not in FORMATS[formats]:
        raise ValueError("a pseudonym map de-identifies the SR: use --format sr or both")
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    os.makedirs(out_dir, exist_ok=True)
    lock = acquire_output_lock(out_dir, tool="predict")  # one run per output folder
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_sigterm_exits())
            stack.enter_context(_library_warnings_counted())
            outputs = _Outputs(out_dir)
            stack.callback(outputs.close)
            pseudonyms = None
            if sr_pseudonym_map is not None:
                pseudonyms = stack.enter_context(PseudonymMap(sr_pseudonym_map, out_dir))
            report = _InputRelativeReport("predict", inputs, out_dir)
            if outputs.removed:
                logger.info("removed %d files of the previous run in %s (its manifest %s)",
                            outputs.removed, out_dir, MANIFEST)
            return _predict(cfg, weights, inputs, outputs, report, FORMATS[formats], pseudonyms,
                            score_thresh=score_thresh, overlay_thresh=overlay_thresh,
                            overlays=overlays, share_features=share_features,
                            num_workers=num_workers, views_csv=views_csv)
    finally:
        lock.release()


def _predict(cfg, weights, inputs, outputs, report, formats, pseudonyms, *, score_thresh,
             overlay_thresh, overlays, share_features, num_workers, views_csv):
    overrides = load_views_csv(views_csv, report) if views_csv else None
    records, exams_out = [], []
    # Exam.key is a public-salt hash of (patient, study or date): a PatientID could be found
    # from it by enumeration. predictions.json gets it keyed by a secret of this run only, so
    # its keys tell this run's exams apart and link to nothing outside it.
    secret = secrets.token_bytes(32)
    run_key = lambda k: hmac.new(secret, k.encode("utf-8"), "sha256").hexdigest()[:16]
    with ExamPredictor(cfg, weights, share_features=share_features, num_workers=num_workers,
                       keep_images=overlays) as predictor:
        exams = predictor.exams(inputs, report, overrides=overrides)
        for exam_no, (exam, preds) in enumerate(predictor.predict_exams(exams, report)):
            if not preds:
                continue
            breasts, exam_scores = breast_exam_scores(
                (exam_no, p.meta.laterality, image_score(p.scores)) for p in preds)
            breast_scores = {lat: s for (_, lat), s in breasts.items()}
            exams_out.append({"exam": exam_no, "key": run_key(exam.key),
                              "score": round(exam_scores[exam_no], 5),
                              "breasts": {k: round(v, 5) for k, v in breast_scores.items()},
                              "records": [p.record_id for p in preds]})
            for pred in preds:
                records.append({**detections_record(pred, score_thresh), "exam": exam_no})
            if overlays:
                _overlays(preds, exam_no, outputs, overlay_thresh, report)
            if "sr" in formats:
                _write_sr(preds, breast_scores, exam_scores[exam_no], exam_no, outputs,
                          score_thresh, pseudonyms, report)
    result = {"images": records, "exams": exams_out, "report": report.to_dict()["counts"]}
    if "json" in formats:
        outputs.write_json("predictions.json", result)
    outputs.write_json("report.json", report.to_dict())
    logger.info(report.summary())
    logger.info(f"{len(records)} image predictions in {len(exams_out)} exams, {outputs.root}")
    return result
