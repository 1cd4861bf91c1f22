"""Malignancy scores of breasts and exams from a detector's boxes, and their AUC.

The paper reports lesion detection only; a screening programme decides per breast and per exam.
Our choice (no classifier head is kept in the detector): after the detector's own NMS and test
score threshold,

* image score  = the highest detection score of the image (0 when it has no detection);
* breast score = the highest image score over the breast's images (CC and MLO, repeats);
* exam score   = the highest breast score of the exam.

A max keeps the score of the one suspicious finding that a reader must see (a mean would dilute
it with the normal views). The same functions score predictions.json and the test-split AUC
(``MammoDetectionEvaluator``), so the evaluated number is the delivered one.

``paired_view_rescore`` (``TEST.BRAIXDET.PAIRED_VIEW_RESCORE``, off by default) multiplies each
box's score by the image score of its paired view (the other view of the same breast; without
one, the image itself, the pairing rule of training): a lesion is seen in both views, a
look-alike or a texture blob mostly in one. It runs before the scores above, so they and AP see
the same rescored boxes (docs/RESULTS.md §26–27).
"""
import math
from collections import defaultdict

import numpy as np

__all__ = ["image_score", "breast_exam_scores", "breast_exam_auc", "paired_view_rescore"]


def image_score(scores) -> float:
    """Highest detection score of one image; 0.0 without detections."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    return float(s.max()) if s.size else 0.0


def paired_view_rescore(scores, partner):
    """``scores``: {image: detection scores}; ``partner``: {image: its paired view's image}
    (itself without a partner; so is a partner missing from ``scores``, an image not
    predicted). Returns {image: scores × image_score(the partner's scores)}."""
    top = {i: image_score(s) for i, s in scores.items()}
    out = {}
    for i, s in scores.items():
        j = partner.get(i, i)
        out[i] = np.asarray(s, dtype=np.float64) * top[j if j in top else i]
    return out


def breast_exam_scores(items):
    """``items``: iterable of (exam, laterality, image score). Returns
    ``({(exam, laterality): breast score}, {exam: exam score})`` (max over images / breasts)."""
    breasts = defaultdict(lambda: -math.inf)
    for exam, lat, score in items:
        breasts[(exam, lat)] = max(breasts[(exam, lat)], float(score))
    exams = defaultdict(lambda: -math.inf)
    for (exam, _), s in breasts.items():
        exams[exam] = max(exams[exam], s)
    return dict(breasts), dict(exams)


def _auc(labels, scores):
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels, dtype=np.int64)
    if len(np.unique(y)) < 2:  # AUC is undefined with one class: NaN (null in metrics.json)
        return float("nan")
    return float(roc_auc_score(y, np.asarray(scores, dtype=np.float64)))


def breast_exam_auc(records, image_scores):
    """Breast- and exam-level ROC AUC (fractions, NaN with one class).

    ``records``: dataset dicts (``exam_id``, ``laterality``, ``label`` 0/1 malignant; without
    ``label``: malignant iff it has annotations); ``image_scores``: {image_id: image score} for
    the evaluated images (a dict without exam_id / laterality is an exam / breast of its own).
    A breast (exam) is malignant when any of its evaluated images is.
    Returns ``(breast_auc, exam_auc, num_breasts, num_exams)``."""
    items, labels = [], []
    for image_id, score in image_scores.items():
        r = records[image_id]
        label = int(r["label"]) if "label" in r else int(bool(r.get("annotations")))
        key = (str(r.get("exam_id", image_id)), str(r.get("laterality", image_id)))
        items.append((*key, score))
        labels.append((key, label))
    breasts, exams = breast_exam_scores(items)
    breast_label, exam_label = defaultdict(int), defaultdict(int)
    for key, label in labels:
        breast_label[key] |= label
        exam_label[key[0]] |= label
    b = sorted(breasts)
    e = sorted(exams)
    return (_auc([breast_label[k] for k in b], [breasts[k] for k in b]),
            _auc([exam_label[k] for k in e], [exams[k] for k in e]), len(b), len(e))
