"""CBIS-DDSM loader (docs/DESIGN.md §6): four case-description CSVs, one row per abnormality.

Choices (documented in datasets/README.md):
- one dict per physical mammogram: rows are grouped by (CSV patient ``P_xxxxx``, breast, view), so
  the Mass-* and Calc-* copies of the same mammogram become one image with all its lesions;
- targets are the MALIGNANT abnormalities; each ROI mask gives ONE box, the bounding box of its
  connected components (specks < 1 % of the largest component ignored): a calcification cluster
  is one lesion, not one box per calcification;
- a mask whose size differs from its mammogram is rescaled to the mammogram grid (counted as
  ``mask_rescaled``); a malignant lesion whose mask cannot be read makes the image "weak" (label
  kept, boxes withheld, counted as ``made_weak``) instead of training on a missing lesion;
- a patient listed in both a train and a test CSV goes entirely to test (``split_conflict``).
"""
import collections
import logging
import os

import cv2
import numpy as np

from ..dicom import pseudonymise
from ..report import BadInputError
from .common import (
    check_view_agreement,
    checked_annotations,
    finish,
    is_under,
    normalize_laterality,
    normalize_view,
    read_csv_rows,
    read_meta,
    resolve_in_root,
)

logger = logging.getLogger(__name__)

CSV_NAMES = {
    "mass_case_description_train_set.csv": "train",
    "calc_case_description_train_set.csv": "train",
    "mass_case_description_test_set.csv": "test",
    "calc_case_description_test_set.csv": "test",
}
_REQUIRED = ["patient_id", "left_or_right_breast", "image_view", "pathology", "image_file_path",
             "roi_mask_file_path"]
_MIN_COMPONENT_FRACTION = 0.01  # ignore mask specks smaller than this fraction of the largest


def _tree_bases(root):
    """Folders the CSV paths are relative to: the TCIA download folder, else the root."""
    return [b for b in (os.path.join(root, "CBIS-DDSM"), root) if os.path.isdir(b)]


def _dcm_files(folder):
    out = []
    for dirpath, dirnames, files in os.walk(folder):
        dirnames.sort()
        out += [os.path.join(dirpath, f) for f in sorted(files) if f.lower().endswith(".dcm")]
    return out


def resolve_cbis_path(root, cell):
    """CSV path cell -> list of candidate DICOM files.

    The exact path when it exists; else every .dcm under the path's first folder (the CSV says
    ``.../000000.dcm`` while the TCIA download tree has ``.../<other dirs>/1-1.dcm``).
    Raises BadInputError ``path_escapes_root`` / ``missing_file``.
    """
    cell = cell.strip().replace("\\", "/")
    bases = _tree_bases(root)
    for base in bases:
        path = resolve_in_root(root, cell, base)  # raises path_escapes_root
        if os.path.isfile(path):
            return [path]
    first = cell.split("/")[0]
    for base in bases:
        folder = resolve_in_root(root, first, base)
        if os.path.isdir(folder) and folder != os.path.normpath(base):
            files = [f for f in _dcm_files(folder) if is_under(f, root)]
            if files:
                return files
    raise BadInputError(cell, "missing_file")


def _read_raw(path):
    """Raw stored pixel values of a (mask) DICOM, no windowing."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        ds = pydicom.dcmread(path)
    except (InvalidDicomError, EOFError, OSError) as e:
        raise BadInputError(path, "not_dicom", type(e).__name__) from None
    if "PixelData" not in ds:
        raise BadInputError(path, "no_pixel_data")
    try:
        arr = ds.pixel_array
    except Exception as e:  # noqa: BLE001 - any decoder failure is one bad file
        raise BadInputError(path, "undecodable", f"{ds.file_meta.get('TransferSyntaxUID', '?')}: "
                            f"{type(e).__name__}") from None
    if arr.ndim != 2:
        raise BadInputError(path, "bad_dimensions", f"shape {arr.shape}")
    return arr


def _header_size(path):
    import pydicom

    try:
        ds = pydicom.dcmread(path, stop_before_pixels=True)
        return int(ds.Rows), int(ds.Columns)
    except Exception:  # noqa: BLE001 - unreadable -> decided when reading the pixels
        return None


def _is_binary(arr):
    top = arr.max()
    return top > 0 and not np.any((arr != 0) & (arr != top))


def mask_box(mask):
    """XYXY box (pixel edges) of the mask's connected components, specks ignored; None if empty."""
    n, _, stats, _ = cv2.connectedComponentsWithStats((mask > 0).astype(np.uint8), connectivity=8)
    if n <= 1:
        return None
    stats = stats[1:]
    areas = stats[:, cv2.CC_STAT_AREA]
    keep = stats[areas >= max(1, _MIN_COMPONENT_FRACTION * areas.max())]
    x0 = keep[:, cv2.CC_STAT_LEFT].min()
    y0 = keep[:, cv2.CC_STAT_TOP].min()
    x1 = (keep[:, cv2.CC_STAT_LEFT] + keep[:, cv2.CC_STAT_WIDTH]).max()
    y1 = (keep[:, cv2.CC_STAT_TOP] + keep[:, cv2.CC_STAT_HEIGHT]).max()
    return [float(x0), float(y0), float(x1), float(y1)]


def find_mask(candidates, image_hw, cropped_exact=None):
    """Pick the ROI mask among candidate files by content.

    The mask is the binary (0/255 or 0/1) image with the mammogram's size; the other candidate is
    the cropped lesion. Without a same-size binary candidate, the largest binary one is taken (its
    box will be rescaled). Returns (path, raw array); raises BadInputError ``bad_mask``.
    """
    same = [c for c in candidates if _header_size(c) == tuple(image_hw)]
    others = [c for c in candidates if c not in same]
    errors = []
    best = None
    for group in (same, others):
        for c in group:
            try:
                arr = _read_raw(c)
            except BadInputError as e:
                errors.append(e)
                continue
            if _is_binary(arr) and (best is None or arr.size > best[1].size):
                best = (c, arr)
        if best is not None:
            return best
    if errors and len(errors) == len(candidates):
        raise errors[0]
    raise BadInputError(candidates[0], "bad_mask", "no binary mask among the ROI files")


def load_cbis_ddsm(root, report, allow_for_processing=False):
    """All images of a CBIS-DDSM download as BRAIxDet dataset dicts (docs/DESIGN.md §2), views
    paired."""
    root = os.path.abspath(root)
    rows_by_image = collections.defaultdict(list)  # (P_xxxxx, lat, view) -> [(split, row, where)]
    n_csv = 0
    for csv_name, split in CSV_NAMES.items():
        csv_path = os.path.join(root, csv_name)
        if not os.path.isfile(csv_path):
            logger.warning("CBIS-DDSM: %s not found, skipped", csv_name)
            continue
        n_csv += 1
        for line, row in read_csv_rows(csv_path, report, _REQUIRED):
            where = f"{csv_name}:{line}"
            try:
                lat = normalize_laterality(row["left_or_right_breast"])
                view = normalize_view(row["image_view"])
                pathology = row["pathology"].upper()
                bad = lat is None or view is None or \
                    not pathology.startswith(("MALIGNANT", "BENIGN"))
            except Exception as e:  # noqa: BLE001 - one hostile row never stops the loader
                report.add(BadInputError(csv_path, "bad_row", f"line {line}: unreadable row "
                                         f"({type(e).__name__})"))
                continue
            if bad:
                report.add(BadInputError(csv_path, "bad_row", f"line {line}: bad laterality/"
                                         "view/pathology"))
                continue
            rows_by_image[(row["patient_id"], lat, view)].append((split, row, where))
    if n_csv == 0:
        raise FileNotFoundError(f"no CBIS-DDSM case-description CSV in {root}")

    test_patients = {k[0] for k, rows in rows_by_image.items()
                     if any(s == "test" for s, *_ in rows)}
    dicts = []
    for (patient, lat, view), rows in sorted(rows_by_image.items()):
        try:
            d = _load_image(root, patient, lat, view, rows, report, allow_for_processing)
        except BadInputError:
            raise  # report.add with on_bad_input="error"
        except Exception as e:  # noqa: BLE001 - one hostile row never stops the loader
            csv_name, line = rows[0][2].rsplit(":", 1)
            report.add(BadInputError(os.path.join(root, csv_name), "bad_row",
                                     f"line {line}: unreadable row ({type(e).__name__})"))
            continue
        if d is None:
            continue
        if patient in test_patients and d["split"] != "test":
            report.count("split_conflict")
            d["split"] = "test"
        dicts.append(d)
    return finish(dicts, report, "CBIS-DDSM")


def _load_image(root, patient, lat, view, rows, report, allow_for_processing):
    # The full mammogram: the first image path (sorted) that resolves to a good DICOM.
    image_path, meta = None, None
    for cell in sorted({r["image_file_path"] for _, r, _ in rows}):
        try:
            cands = resolve_cbis_path(root, cell)
        except BadInputError as e:
            where = next(w for _, r, w in rows if r["image_file_path"] == cell)
            report.add(BadInputError(e.path, e.reason, f"{where}: {e.detail}".rstrip(": ")))
            continue
        if len(cands) > 1:
            # a full-image folder should hold one file; take the largest (the mammogram)
            report.count("ambiguous_image_folder")
            cands = [max(cands, key=lambda c: (os.path.getsize(c), c))]
        meta = read_meta(cands[0], report, allow_for_processing)
        if meta is not None:
            image_path = cands[0]
            break
    if image_path is None:
        return None
    if len({r["image_file_path"] for _, r, _ in rows}) > 1:
        report.count("merged_duplicate_image")
    check_view_agreement(meta, lat, view, report)
    h, w = int(meta.rows), int(meta.cols)

    boxes, made_weak = [], False
    malignant = [(r, where) for _, r, where in rows if r["pathology"].upper() == "MALIGNANT"]
    for r, where in malignant:
        try:
            cands = resolve_cbis_path(root, r["roi_mask_file_path"])
            cropped_cell = r.get("cropped_image_file_path", "")
            if cropped_cell:
                try:
                    cands = cands + [c for c in resolve_cbis_path(root, cropped_cell)
                                     if c not in cands]
                except BadInputError:
                    pass  # the cropped image is only a swap candidate
            mask_path, mask = find_mask(cands, (h, w))
        except BadInputError as e:
            report.add(BadInputError(e.path, e.reason, f"{where}: {e.detail}".rstrip(": ")))
            made_weak = True
            continue
        if os.path.basename(mask_path) != os.path.basename(r["roi_mask_file_path"].strip()) and \
                os.path.basename(mask_path) == os.path.basename(cropped_cell.strip()):
            report.count("mask_swapped")
        box = mask_box(mask)
        if box is None:
            report.add(BadInputError(mask_path, "bad_mask", f"{where}: empty mask"))
            made_weak = True
            continue
        mh, mw = mask.shape
        if (mh, mw) != (h, w):
            sx, sy = w / mw, h / mh
            box = [box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy]
            report.count("mask_rescaled")
        boxes.append(box)

    pid = pseudonymise(patient)
    split = "test" if any(s == "test" for s, *_ in rows) else "train"
    d = {
        "file_name": image_path,
        "image_id": f"{pid}_{lat}_{view}",
        "exam_id": pid,  # DDSM: one exam per case; the per-view DICOM StudyUIDs differ
        "patient_id": pid,
        "laterality": lat,
        "view": view,
        "height": h,
        "width": w,
        "label": int(bool(malignant)),
        "split": split,
        "annotation_type": "full",
    }
    if made_weak:
        report.count("made_weak")
        d["annotation_type"] = "weak"
    else:
        d["annotations"] = checked_annotations(boxes, h, w, image_path, report)
    return d
