"""In-house exam CSV loader (ADMANI-like; columns documented in datasets/README.md).

``patient_id,exam_id,image_path,laterality,view,cancer_label,annotation,boxes,split``: one row per
image; image_path relative to the CSV's folder (or absolute, inside the root); boxes a JSON list of
[x0, y0, x1, y1] in original pixels (malignant lesions; "[]" for weak or lesion-free images).
patient_id and exam_id are pseudonymised (they may be hospital identifiers).
"""
import logging
import os

from ..dicom import pseudonymise
from ..report import BadInputError
from .common import (
    CellError,
    check_view_agreement,
    checked_annotations,
    finish,
    load_csv_rows,
    normalize_laterality,
    normalize_view,
    parse_boxes_json,
    read_meta,
    resolve_in_root,
)

logger = logging.getLogger(__name__)

REQUIRED = ["patient_id", "exam_id", "image_path", "laterality", "view", "cancer_label",
            "annotation"]
_SPLITS = {"train": "train", "training": "train", "test": "test"}


def _parse_row(row):
    """Validated fields of one row, or a string saying what is wrong."""
    lat, view = normalize_laterality(row["laterality"]), normalize_view(row["view"])
    if lat is None or view is None:
        return "laterality must be L|R and view CC|MLO"
    if row["cancer_label"] not in ("0", "1"):
        return "cancer_label must be 0|1"
    ann = row["annotation"].lower()
    if ann not in ("full", "weak"):
        return "annotation must be full|weak"
    split = _SPLITS.get((row.get("split") or "train").lower())
    if split is None:
        return "split must be train|test"
    try:
        boxes = parse_boxes_json(row.get("boxes") or "[]")
    except CellError as e:
        return str(e)
    label = int(row["cancer_label"])
    if label == 0 and boxes:
        return "cancer_label 0 with malignant boxes"
    return lat, view, label, ann, split, boxes


def load_exam_csv(csv_path, root, report, allow_for_processing=False):
    """Images listed in an exam CSV as BRAIxDet dataset dicts (docs/DESIGN.md §2), views paired."""
    root = os.path.abspath(root)
    if not os.path.isabs(csv_path) and not os.path.isfile(csv_path):
        csv_path = os.path.join(root, csv_path)
    csv_path = os.path.abspath(csv_path)
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"exam CSV {csv_path} not found")
    base = os.path.dirname(csv_path)
    seen = set()
    dicts = load_csv_rows(csv_path, report, REQUIRED, lambda line, row: _load_row(
        line, row, root, base, csv_path, seen, report, allow_for_processing))
    return finish(dicts, report, "exam CSV")


def _load_row(line, row, root, base, csv_path, seen, report, allow_for_processing):
    """One CSV row -> dataset dict, or None (the problem is in the report)."""
    parsed = _parse_row(row)
    if isinstance(parsed, str):
        report.add(BadInputError(csv_path, "bad_row", f"line {line}: {parsed}"))
        return None
    lat, view, label, ann, split, boxes = parsed
    try:
        path = resolve_in_root(root, row["image_path"], base)
    except BadInputError as e:
        where = f"{os.path.basename(csv_path)} line {line}"
        report.add(BadInputError(e.path, e.reason, f"{where}: {e.detail}" if e.detail else where))
        return None
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    if rel in seen:
        report.add(BadInputError(csv_path, "bad_row", f"line {line}: duplicate image_path"))
        return None
    seen.add(rel)
    meta = read_meta(path, report, allow_for_processing)
    if meta is None:
        return None
    check_view_agreement(meta, lat, view, report)
    h, w = int(meta.rows), int(meta.cols)
    pid = pseudonymise(row["patient_id"])
    d = {
        "file_name": path,
        "image_id": "img_" + pseudonymise(rel.replace(os.sep, "/")),
        "exam_id": pseudonymise(row["patient_id"] + "/" + row["exam_id"]),
        "patient_id": pid,
        "laterality": lat,
        "view": view,
        "height": h,
        "width": w,
        "label": label,
        "split": split,
        "annotation_type": ann,
    }
    if ann == "full" and label == 1 and not boxes:
        report.count("full_without_boxes")  # a cancer without its box cannot train boxes
        d["annotation_type"] = "weak"
    elif ann == "full":
        d["annotations"] = checked_annotations(boxes, h, w, path, report)
    return d
