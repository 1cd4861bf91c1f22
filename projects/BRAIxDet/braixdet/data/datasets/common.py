"""Helpers shared by the dataset loaders: safe path resolution, views, boxes, DICOM checks."""
import logging
import os

import numpy as np
from detectron2.structures import BoxMode

from ..pairing import pair_views
from ..report import BadInputError
from ..views import normalize_laterality, normalize_view  # noqa: F401 (re-export for the loaders)

logger = logging.getLogger(__name__)


def is_under(path, root):
    """True when ``path`` resolves (symlinks included) inside ``root``."""
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    return real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep)


def resolve_in_root(root, rel_path, base=None):
    """Join a CSV path cell to ``base`` (default ``root``) and refuse anything outside ``root``.

    Raises BadInputError(reason="path_escapes_root") for e.g. ``../../etc/passwd`` or an absolute
    path elsewhere; the caller decides whether the file must exist.
    """
    rel_path = str(rel_path).strip()
    path = os.path.normpath(os.path.join(base or root, rel_path))
    if not is_under(path, root):
        raise BadInputError(rel_path, "path_escapes_root")
    return path


def clip_box(box, height, width):
    """Clip an XYXY box to the image; None when fully outside or degenerate.

    Returns (clipped box as list of floats, was_clipped).
    """
    x0, y0, x1, y1 = (float(v) for v in box)
    if not np.all(np.isfinite([x0, y0, x1, y1])) or x1 <= x0 or y1 <= y0:
        return None, False
    c = [min(max(x0, 0.0), width), min(max(y0, 0.0), height),
         min(max(x1, 0.0), width), min(max(y1, 0.0), height)]
    if c[2] - c[0] < 1 or c[3] - c[1] < 1:  # outside (or a sliver on the edge)
        return None, False
    return c, c != [x0, y0, x1, y1]


def checked_annotations(boxes, height, width, path, report):
    """Boxes -> detectron2 annotations; boxes outside the image are clipped (counted) or dropped
    (one ``box_outside_image`` bad input each)."""
    annos = []
    for box in boxes:
        c, clipped = clip_box(box, height, width)
        if c is None:
            report.add(BadInputError(path, "box_outside_image",
                                     f"box {list(box)} vs image {width}x{height}"))
            continue
        if clipped:
            report.count("box_clipped")
        annos.append({"bbox": c, "bbox_mode": BoxMode.XYXY_ABS, "category_id": 0})
    return annos


def read_meta(path, report, allow_for_processing=False):
    """DICOM header via dicom.read_dicom_meta; bad files go to the report (None returned)."""
    from ..dicom import read_dicom_meta  # lazy: keeps CSV parsing importable on its own

    if not os.path.isfile(path):
        report.add(BadInputError(path, "missing_file"))
        return None
    try:
        return read_dicom_meta(path, allow_for_processing=allow_for_processing)
    except BadInputError as e:
        report.add(e)
        return None


def read_csv_rows(csv_path, report, required):
    """Yield (line_number, row dict with normalised keys) of a CSV.

    Header names are normalised (stripped, lower case, spaces -> '_') so
    ``breast density``/``breast_density`` both read as ``breast_density``. Rows lacking a required
    column value are reported as ``bad_row`` with their line number and skipped.
    """
    import csv

    with open(csv_path, newline="", encoding="utf-8-sig", errors="replace") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            report.add(BadInputError(csv_path, "bad_row", "empty CSV"))
            return
        keys = [h.strip().lower().replace(" ", "_") for h in header]
        missing = [k for k in required if k not in keys]
        if missing:
            report.add(BadInputError(csv_path, "bad_row", f"line 1: missing columns {missing}"))
            return
        while True:
            try:
                cells = next(reader)
            except StopIteration:
                break
            except csv.Error as e:  # e.g. NUL byte, unterminated quote
                report.add(BadInputError(csv_path, "bad_row", f"line {reader.line_num}: {e}"))
                continue
            line = reader.line_num
            if not any(c.strip() for c in cells):
                continue  # blank line
            if len(cells) != len(keys):
                report.add(BadInputError(csv_path, "bad_row",
                                         f"line {line}: {len(cells)} cells, {len(keys)} columns"))
                continue
            row = {k: c.strip() for k, c in zip(keys, cells)}
            empty = [k for k in required if not row[k]]
            if empty:
                report.add(BadInputError(csv_path, "bad_row", f"line {line}: empty {empty}"))
                continue
            yield line, row


def finish(dicts, report, name):
    """Pair views, sort deterministically, log the summary line."""
    dicts = sorted(dicts, key=lambda d: d["image_id"])
    pair_views(dicts, report)
    n_pos = sum(d["label"] for d in dicts)
    logger.info("%s: %d images (%d malignant), %d patients", name, len(dicts), n_pos,
                len({d["patient_id"] for d in dicts}))
    return dicts
