"""VinDr-Mammo loader (docs/DESIGN.md §6): breast-level + finding CSVs, images/<study>/<id>.dicom.

Malignant = a finding with BI-RADS in ``malignant_birads`` (default 4/5, **choice**); an image's
label is 1 when it has one. Every image is "full" (VinDr boxes all findings). VinDr has no
patient id: the study is the patient (one screening exam per woman), pseudonymised.
"""
import collections
import logging
import os
import re

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
    parse_number,
    read_csv_rows,
    read_meta,
    resolve_in_root,
)

logger = logging.getLogger(__name__)

_BREAST_REQUIRED = ["study_id", "image_id", "laterality", "view_position", "split"]
_FINDING_REQUIRED = ["study_id", "image_id"]  # finding_birads is empty for "No Finding"
_SPLITS = {"training": "train", "train": "train", "test": "test"}


def parse_birads(text):
    """'BI-RADS 4' / '4' / 'BI-RADS 4A' -> 4; None when absent ('', 'nan', 'No Finding')."""
    m = re.search(r"(\d)", str(text))
    return int(m.group(1)) if m else None


def load_vindr_mammo(root, report, malignant_birads=(4, 5), allow_for_processing=False):
    """All VinDr-Mammo images as BRAIxDet dataset dicts (docs/DESIGN.md §2), views paired."""
    root = os.path.abspath(root)
    malignant_birads = {int(b) for b in malignant_birads}
    breast_csv = os.path.join(root, "breast-level_annotations.csv")
    finding_csv = os.path.join(root, "finding_annotations.csv")
    for p in (breast_csv, finding_csv):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"VinDr-Mammo: {p} not found")

    boxes = collections.defaultdict(list)  # image_id -> malignant boxes
    for line, row in read_csv_rows(finding_csv, report, _FINDING_REQUIRED):
        try:
            malignant = parse_birads(row.get("finding_birads", "")) in malignant_birads
            box = [parse_number(row.get(k, ""), k) for k in ("xmin", "ymin", "xmax", "ymax")] \
                if malignant else None
        except CellError as e:
            report.add(BadInputError(finding_csv, "bad_row", f"line {line}: malignant finding "
                                     f"without a valid box ({e})"))
            boxes[row["image_id"]].append(None)  # -> the image becomes weak
            continue
        except Exception as e:  # noqa: BLE001 - one hostile row never stops the loader
            report.add(BadInputError(finding_csv, "bad_row", f"line {line}: unreadable row "
                                     f"({type(e).__name__})"))
            continue
        if malignant:
            boxes[row["image_id"]].append(box)

    seen = set()
    dicts = load_csv_rows(breast_csv, report, _BREAST_REQUIRED, lambda line, row: _load_row(
        line, row, root, breast_csv, boxes, seen, report, allow_for_processing))
    return finish(dicts, report, "VinDr-Mammo")


def _load_row(line, row, root, breast_csv, boxes, seen, report, allow_for_processing):
    """One breast-level row -> dataset dict, or None (the problem is in the report)."""
    lat, view = normalize_laterality(row["laterality"]), normalize_view(row["view_position"])
    split = _SPLITS.get(row["split"].lower())
    if lat is None or view is None or split is None or row["image_id"] in seen:
        report.add(BadInputError(breast_csv, "bad_row", f"line {line}: bad laterality/view/"
                                 "split or duplicate image_id"))
        return None
    seen.add(row["image_id"])
    try:
        path = resolve_in_root(root, os.path.join("images", row["study_id"],
                                                  row["image_id"] + ".dicom"))
    except BadInputError as e:
        where = f"{os.path.basename(breast_csv)} line {line}"
        report.add(BadInputError(e.path, e.reason, f"{where}: {e.detail}" if e.detail
                                 else where))
        return None
    meta = read_meta(path, report, allow_for_processing)
    if meta is None:
        return None
    check_view_agreement(meta, lat, view, report)
    h, w = int(meta.rows), int(meta.cols)
    if row.get("height") and row.get("width"):
        try:
            csv_hw = (int(parse_number(row["height"], "height")),
                      int(parse_number(row["width"], "width")))
            if csv_hw != (h, w):
                report.count("size_mismatch_csv")  # boxes follow the DICOM grid
        except CellError as e:
            report.add(BadInputError(breast_csv, "bad_row", f"line {line}: {e}"))
            return None
    img_boxes = boxes.get(row["image_id"], [])
    pid = pseudonymise(row["study_id"])
    d = {
        "file_name": path,
        "image_id": row["image_id"],
        "exam_id": row["study_id"],
        "patient_id": pid,
        "laterality": lat,
        "view": view,
        "height": h,
        "width": w,
        "label": int(bool(img_boxes)),
        "split": split,
        "annotation_type": "full",
    }
    if any(b is None for b in img_boxes):
        report.count("made_weak")
        d["annotation_type"] = "weak"
    else:
        d["annotations"] = checked_annotations(img_boxes, h, w, path, report)
    return d
