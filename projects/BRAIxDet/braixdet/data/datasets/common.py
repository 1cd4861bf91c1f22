"""Helpers shared by the dataset loaders: safe path resolution, views, boxes, DICOM checks."""
import logging
import os

import numpy as np
from detectron2.structures import BoxMode

from ..dicom import read_dicom_meta
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
    if "\0" in rel_path:  # os.path.realpath would raise ValueError
        raise BadInputError(rel_path.replace("\0", "\\0"), "bad_row", "NUL byte in a path")
    path = os.path.normpath(os.path.join(base or root, rel_path))
    if not is_under(path, root):
        raise BadInputError(rel_path, "path_escapes_root")
    return path


# Bounds on what a CSV cell may hold (hostile or broken files): longer cells, longer numbers,
# larger coordinates and deeper nesting are bad rows, never exceptions.
MAX_CELL_CHARS = 65536  # per cell; ~1000 boxes in a ``boxes`` cell
MAX_NUMBER_CHARS = 32
MAX_ABS_NUMBER = 1e6  # pixel coordinates and image sizes
MAX_BOXES = 1000
_NUMBER_PATTERN = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"


class CellError(ValueError):
    """A CSV cell that is not what its column must hold; ``str`` says why (one line)."""


def _short(text, n=24):
    text = str(text)
    return repr(text if len(text) <= n else text[:n] + "...")


def parse_number(text, what="value"):
    """A plain decimal number cell -> float: at most 32 characters, finite, |v| <= 1e6.

    Refuses what ``float()`` would accept but a coordinate must not be: ``nan``, ``inf``,
    ``1e999``, ``1_000``, non-ASCII digits, ``true``, and 400-digit numbers (CellError).
    """
    import re

    text = str(text).strip()
    if len(text) > MAX_NUMBER_CHARS:
        raise CellError(f"{what} has {len(text)} characters (limit {MAX_NUMBER_CHARS})")
    if not re.fullmatch(_NUMBER_PATTERN, text, flags=re.ASCII):
        raise CellError(f"{what} {_short(text)} is not a plain decimal number")
    v = float(text)
    if not abs(v) <= MAX_ABS_NUMBER:  # also catches inf (1e999) and nan
        raise CellError(f"{what} {_short(text)} is not a finite number within "
                        f"+-{MAX_ABS_NUMBER:g}")
    return v


def parse_boxes_json(text, what="boxes"):
    """A JSON cell ``[[x0, y0, x1, y1], ...]`` -> list of 4-float lists, strictly bounded.

    Nesting deeper than a list of lists is refused before JSON parsing (no RecursionError);
    numbers go through ``parse_number`` (no OverflowError from 400-digit integers, no NaN/
    Infinity); booleans, strings and nulls are refused (JSON ``true`` is not the number 1).
    Raises CellError naming the problem.
    """
    import json
    import re

    text = str(text).strip() or "[]"
    if len(text) > MAX_CELL_CHARS:
        raise CellError(f"{what} cell has {len(text)} characters (limit {MAX_CELL_CHARS})")
    depth = 0
    for ch in re.sub(r"[^\[\]{}]", "", text):
        depth += 1 if ch in "[{" else -1
        if depth > 2:
            raise CellError(f"{what} nested deeper than a list of [x0, y0, x1, y1] lists")

    def bad_constant(name):
        raise CellError(f"{what}: {name} is not a finite number")

    try:
        boxes = json.loads(text, parse_int=lambda s: parse_number(s, "coordinate"),
                           parse_float=lambda s: parse_number(s, "coordinate"),
                           parse_constant=bad_constant)
    except CellError:
        raise
    except ValueError as e:  # JSONDecodeError
        raise CellError(f"{what} is not valid JSON ({str(e).splitlines()[0][:80]})") from None
    if not isinstance(boxes, list):
        raise CellError(f"{what} must be a JSON list of [x0, y0, x1, y1]")
    if len(boxes) > MAX_BOXES:
        raise CellError(f"{what} has {len(boxes)} boxes (limit {MAX_BOXES})")
    for i, b in enumerate(boxes, 1):
        if not isinstance(b, list) or len(b) != 4:
            n = f"{len(b)} values" if isinstance(b, list) else f"a JSON {type(b).__name__}"
            raise CellError(f"{what}: box {i} has {n}, expected [x0, y0, x1, y1]")
        for v in b:
            if type(v) is not float:  # parse_int/parse_float give floats: bool, str, None left
                raise CellError(f"{what}: box {i} holds {json.dumps(v)[:24]}, not a number")
    return boxes


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
    if not os.path.isfile(path):
        report.add(BadInputError(path, "missing_file"))
        return None
    try:
        return read_dicom_meta(path, allow_for_processing=allow_for_processing)
    except BadInputError as e:
        report.add(e)
        return None


def check_view_agreement(meta, lat, view, report):
    """The CSV's laterality/view win; where the DICOM's own (``views.resolve_view``, the
    predictor's resolver) names another, count ``laterality_disagreement`` /
    ``view_disagreement`` so the user sees a mislabelled archive."""
    if meta.laterality and meta.laterality != lat:
        report.count("laterality_disagreement")
    if meta.view and meta.view != view:
        report.count("view_disagreement")


def load_csv_rows(csv_path, report, required, load_row):
    """Dataset dicts of a CSV: ``load_row(line, row)`` per row (None = skipped, already in the
    report). Any exception of one hostile row is that row's ``bad_row``; the loader goes on."""
    dicts = []
    for line, row in read_csv_rows(csv_path, report, required):
        try:
            d = load_row(line, row)
        except BadInputError:
            raise  # report.add with on_bad_input="error"
        except Exception as e:  # noqa: BLE001 - one hostile row never stops the loader
            report.add(BadInputError(csv_path, "bad_row", f"line {line}: unreadable row "
                                     f"({type(e).__name__})"))
            continue
        if d is not None:
            dicts.append(d)
    return dicts


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
            long = [k for k, c in zip(keys, cells) if len(c) > MAX_CELL_CHARS]
            if long:
                report.add(BadInputError(csv_path, "bad_row", f"line {line}: cell {long[0]!r} "
                                         f"longer than {MAX_CELL_CHARS} characters"))
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
