"""Writes the synthetic dataset: DICOM files and CSVs in the real CBIS-DDSM on-disk layout.

Layout written under ``out_dir`` (the dataset root)::

    {mass,calc}_case_description_{train,test}_set.csv   one row per abnormality (CBIS headers)
    exams.csv                                           the same images, in-house exam format
    CBIS-DDSM/<Prefix>_P_xxxxx_<LEFT|RIGHT>_<CC|MLO>/<study>/<series>/1-1.dcm       mammogram
    CBIS-DDSM/<Prefix>_P_xxxxx_<LEFT|RIGHT>_<CC|MLO>_<k>/<study>/<series>/1-1.dcm   cropped ROI
    CBIS-DDSM/<Prefix>_P_xxxxx_<LEFT|RIGHT>_<CC|MLO>_<k>/<study>/<series>/1-2.dcm   ROI mask

``Prefix`` is Mass-Training, Calc-Training, Mass-Test or Calc-Test. Upstream quirks reproduced:
the CSV names files ``000000.dcm``/``000001.dcm`` while the tree has ``1-1.dcm``/``1-2.dcm``;
for ~10% of abnormalities the mask is ``1-1.dcm`` and the crop ``1-2.dcm``; a few CSV path
cells end with a newline or spaces. Lesion-free breasts (CBIS lists only abnormal images) get a
``Mass-<split>`` folder in the tree but no CSV row; they do appear in ``exams.csv``.

Radiological convention of the originals: laterality L has the chest wall on the image's left
edge (nipple pointing right), R the chest wall on the right edge. Boxes are
``[x0, y0, x1, y1]`` = ``[xmin, ymin, xmax + 1, ymax + 1]`` of the ROI mask's pixels.

Each stage draws from its own generator seeded from ``seed`` (plan ``[seed, 1]``, encodings
``[seed, 2]``, patient ``i`` ``[seed, 3, i]``, its harder-regime options ``[seed, 4, i]`` and
summation look-alikes ``[seed, 5, i]``), so pixels, UIDs and CSVs repeat for a seed; the one
exception is the SOPInstanceUID of JPEG 2000 files, which pydicom's ``Dataset.compress`` replaces
with a fresh random UID.
"""
import contextlib
import csv
import datetime
import functools
import json
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import (
    PYDICOM_IMPLEMENTATION_UID,
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    generate_uid,
)

from .plan import (
    VIEWS,
    benign_findings,
    breast_geometry,
    label_benign,
    label_lesions,
    place_lesions,
    plan_patients,
    sample_lesion,
    summation_lookalikes,
)
from .render import breast_masks, lesion_room, render_view

MASS_HEADER = [
    "patient_id", "breast_density", "left or right breast", "image view", "abnormality id",
    "abnormality type", "mass shape", "mass margins", "assessment", "pathology", "subtlety",
    "image file path", "cropped image file path", "ROI mask file path",
]
CALC_HEADER = [
    "patient_id", "breast density", "left or right breast", "image view", "abnormality id",
    "abnormality type", "calc type", "calc distribution", "assessment", "pathology", "subtlety",
    "image file path", "cropped image file path", "ROI mask file path",
]
EXAM_HEADER = [
    "patient_id", "exam_id", "image_path", "laterality", "view", "cancer_label", "annotation",
    "boxes", "split",
]
DIGITAL_MG_FOR_PRESENTATION = "1.2.840.10008.5.1.4.1.1.1.2"
CBIS_UID_PREFIX = "1.3.6.1.4.1.9590.100.1.2."
SIDES = {"L": "LEFT", "R": "RIGHT"}


# ----------------------------------------------------------------------------- DICOM
def _uid(seed, *parts):
    return generate_uid(prefix=CBIS_UID_PREFIX, entropy_srcs=["braixdet-synth", str(seed),
                                                              *map(str, parts)])


def _write_dicom(path, arr, *, info, sop_uid, photometric="MONOCHROME2", bits_stored=None,
                 jpeg2000=False, description="full mammogram images"):
    """Writes a little-endian explicit (or JPEG 2000 lossless) MG DICOM with file meta."""
    fm = FileMetaDataset()
    fm.MediaStorageSOPClassUID = DIGITAL_MG_FOR_PRESENTATION
    fm.MediaStorageSOPInstanceUID = sop_uid
    fm.TransferSyntaxUID = ExplicitVRLittleEndian
    fm.ImplementationClassUID = PYDICOM_IMPLEMENTATION_UID
    ds = Dataset()
    ds.file_meta = fm
    ds.SOPClassUID = DIGITAL_MG_FOR_PRESENTATION
    ds.SOPInstanceUID = sop_uid
    ds.StudyInstanceUID = info["study_uid"]
    ds.SeriesInstanceUID = info["series_uid"]
    ds.Modality = "MG"
    ds.PatientName = info["PatientName"]
    ds.PatientID = info["PatientID"]
    ds.PatientBirthDate = info["PatientBirthDate"]
    ds.PatientSex = "F"
    ds.StudyDate = ds.SeriesDate = ds.ContentDate = info["StudyDate"]
    ds.StudyTime = ds.SeriesTime = ds.ContentTime = "120000"
    ds.SeriesDescription = description
    ds.BodyPartExamined = "BREAST"
    ds.ImageLaterality = info["laterality"]
    ds.Laterality = info["laterality"]
    ds.ViewPosition = info["view"]
    ds.PresentationIntentType = "FOR PRESENTATION"
    ds.SeriesNumber = 1
    ds.InstanceNumber = 1
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.Rows, ds.Columns = int(arr.shape[0]), int(arr.shape[1])
    ds.BitsAllocated = 8 if arr.dtype == np.uint8 else 16
    ds.BitsStored = bits_stored or ds.BitsAllocated
    ds.HighBit = ds.BitsStored - 1
    ds.PixelRepresentation = 0
    maxval = (1 << ds.BitsStored) - 1
    ds.WindowCenter = maxval // 2
    ds.WindowWidth = maxval
    ds.PixelSpacing = [0.1, 0.1]
    ds.ImagerPixelSpacing = [0.1, 0.1]
    arr = np.ascontiguousarray(arr)
    if jpeg2000 and min(arr.shape) < 32:
        raise ValueError("openjpeg's 6 DWT resolutions need images of at least 32x32 pixels")
    if jpeg2000:
        ds.compress(JPEG2000Lossless, arr, encoding_plugin="pylibjpeg")
    else:
        ds.PixelData = arr.tobytes()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    ds.save_as(path, enforce_file_format=True)


def _to_stored(img, bits, monochrome1):
    maxval = (1 << bits) - 1
    v = np.round(np.clip(img, 0.0, 1.0) * maxval).astype(np.uint16)
    return (maxval - v).astype(np.uint16) if monochrome1 else v


def _bbox(mask):
    ys, xs = np.nonzero(mask)
    return [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]



# ----------------------------------------------------------------------------- dataset
def _encoding_quirks(rng, n_images, rows, cols, monochrome1_fraction, jpeg2000_fraction):
    """Per-image (MONOCHROME1?, JPEG 2000?, BitsStored), fixed up-front; at least one of each
    quirk when there are images."""
    mono1 = rng.uniform(size=n_images) < monochrome1_fraction
    j2k = rng.uniform(size=n_images) < jpeg2000_fraction
    if min(rows, cols) < 32:  # openjpeg cannot encode such tiny images
        jpeg2000_fraction, j2k[:] = 0.0, False
    if n_images >= 4:
        if monochrome1_fraction > 0 and not mono1.any():
            mono1[1] = True
        if jpeg2000_fraction > 0 and not j2k.any():
            j2k[2] = True
    bits = rng.choice([12, 14, 16], size=n_images)
    return mono1, j2k, bits


def _write_patient(pl, *, seed, rows, cols, out_dir, tree, size, anatomy, harder,
                   benign_per_breast, summations_per_view, swap_fraction, mono1, j2k, bits):
    """Write one planned patient's files (its own generators: patients are independent, so
    they may be written in any order or process); returns its truth entries, CSV rows and
    exams.csv rows, in the serial order."""
    truth, rows_csv, exam_rows = [], [], []
    prng = np.random.default_rng([seed, 3, pl["index"]])
    arng = np.random.default_rng([seed, 4, pl["index"]]) if harder else None
    # its own generator: turning summations on leaves every other pixel as it was
    srng = np.random.default_rng([seed, 5, pl["index"]]) if summations_per_view > 0 else None
    p, split = pl["patient"], pl["split"]
    stage = "Training" if split == "train" else "Test"
    anon = f"anon_{pl['index'] + 1:05d}"
    exam_id = f"{anon}_exam1"
    day = datetime.timedelta(days=1)
    birth = datetime.date(1940, 1, 1) + int(prng.integers(0, 13000)) * day
    study_date = datetime.date(2005, 1, 1) + int(prng.integers(0, 1500)) * day
    raw_name = f"SYNTH^PATIENT{pl['index'] + 1:05d}"
    # A hospital-style MRN, distinct from the folder names (CBIS's public per-view IDs are
    # already de-identified), so tests can check that no raw PatientID reaches any output.
    raw_mrn = f"MRN{(seed * 7919 + int(p[2:]) * 104729) % 10**8:08d}"
    density = int(prng.integers(1, 5))
    for lat in ("L", "R"):
        bp = pl["breasts"][lat]
        geo = breast_geometry(prng, rows, cols)
        masks = {v: breast_masks(geo, v, rows, cols) for v in VIEWS}
        allowed = {v: lesion_room(*masks[v]) for v in VIEWS}
        lesions = [sample_lesion(prng, bp["kind"], bp["malignant"][k], cols, **size)
                   for k in range(bp["n"])]
        lesions = place_lesions(prng, lesions, geo, allowed, rows, cols)
        cancer, annotation = label_lesions(prng, lesions, bp["malignant"])
        if benign_per_breast > 0:
            extra = benign_findings(arng, benign_per_breast, cols, **size)
            extra = place_lesions(arng, extra, geo, allowed, rows, cols, occupied=lesions)
            label_benign(arng, extra, len(lesions) + 1)
            lesions = lesions + extra
        summations = {v: summation_lookalikes(srng, summations_per_view, v, geo, allowed,
                                              lesions, rows, cols, **size) if srng else []
                      for v in VIEWS}
        kind = lesions[0]["type"] if lesions else "mass"
        prefix = f"{kind.capitalize()}-{stage}"
        for view in VIEWS:
            img_index = pl["index"] * 4 + (0 if lat == "L" else 2) + VIEWS.index(view)
            img, roi_masks = render_view(prng, geo, masks[view], lesions, view=view,
                                         lat=lat, density=density,
                                         anatomy=dict(anatomy, rng=arng,
                                                      summations=summations[view],
                                                      summation_rng=srng) if harder else None)
            nipple_x = geo["a"] if lat == "L" else cols - 1 - geo["a"]
            folder = f"{prefix}_{p}_{SIDES[lat]}_{view}"
            study, series = _uid(seed, folder, "study"), _uid(seed, folder, "series")
            rel_dir = f"{folder}/{study}/{series}"
            info = {
                "study_uid": study, "series_uid": series, "PatientName": raw_name,
                "PatientID": raw_mrn, "PatientBirthDate": birth.strftime("%Y%m%d"),
                "StudyDate": study_date.strftime("%Y%m%d"), "laterality": lat, "view": view,
            }
            b = int(bits[img_index])
            photometric = "MONOCHROME1" if mono1[img_index] else "MONOCHROME2"
            stored = _to_stored(img, b, mono1[img_index])
            rel_path = f"CBIS-DDSM/{rel_dir}/1-1.dcm"
            _write_dicom(os.path.join(out_dir, rel_path), stored, info=info,
                         sop_uid=_uid(seed, folder, "sop"), photometric=photometric,
                         bits_stored=b, jpeg2000=bool(j2k[img_index]))
            les_truth = []
            for les, m in zip(lesions, roi_masks):
                lrng = arng if les.get("_extra") else prng  # keeps prng's draws as planned
                rfolder = f"{folder}_{les['id']}"
                rstudy, rseries = _uid(seed, rfolder, "study"), _uid(seed, rfolder, "series")
                # ~swap_fraction of ROI folders swap mask/crop (and the dataset's 2nd one:
                # make_synthetic_dataset, which knows the order of the patients)
                swap = bool(lrng.uniform() < swap_fraction)
                rinfo = dict(info, study_uid=rstudy, series_uid=rseries)
                mask_name, crop_name = ("1-1.dcm", "1-2.dcm") if swap else ("1-2.dcm",
                                                                            "1-1.dcm")
                bbox = _bbox(m)
                pad = max(2, int(0.03 * cols))
                x0, y0 = max(0, bbox[0] - pad), max(0, bbox[1] - pad)
                x1, y1 = min(cols, bbox[2] + pad), min(rows, bbox[3] + pad)
                rdir = os.path.join(tree, rfolder, rstudy, rseries)
                _write_dicom(os.path.join(rdir, mask_name), m.astype(np.uint8) * 255,
                             info=rinfo, sop_uid=_uid(seed, rfolder, "mask"),
                             description="ROI mask images")
                _write_dicom(os.path.join(rdir, crop_name), stored[y0:y1, x0:x1],
                             info=rinfo, sop_uid=_uid(seed, rfolder, "crop"),
                             photometric=photometric, bits_stored=b,
                             description="cropped images")
                cx, cy = les["_xy"][view]
                if lat == "R":
                    cx = cols - 1 - cx
                les_truth.append({
                    "lesion_id": les["id"], "abnormality_id": les["id"],
                    "type": les["type"], "pathology": les["pathology"],
                    "malignant": les["pathology"] == "MALIGNANT", "bbox": bbox,
                    "center": [round(cx, 2), round(cy, 2)],
                    "depth": round(abs(nipple_x - cx), 2),
                    "mask_path": f"CBIS-DDSM/{rfolder}/{rstudy}/{rseries}/{mask_name}",
                    "crop_path": f"CBIS-DDSM/{rfolder}/{rstudy}/{rseries}/{crop_name}",
                    "mask_swapped": swap, "contrast": round(float(les["contrast"]), 4),
                })
                csv_img = f"{rel_dir}/000000.dcm"
                csv_crop = f"{rfolder}/{rstudy}/{rseries}/000000.dcm"
                csv_mask = f"{rfolder}/{rstudy}/{rseries}/000001.dcm"
                q = lrng.uniform()  # upstream whitespace quirks in path cells
                if q < 0.08:
                    csv_mask += "\n"
                elif q < 0.14:
                    csv_crop += "  "
                elif q < 0.18:
                    csv_img += " \n"
                if les["type"] == "mass":
                    extra = [les["shape"], les["margins"]]
                else:
                    extra = [les["calc_type"], les["distribution"]]
                key = (les["type"], split)
                rows_csv.append((key, [p, density, SIDES[lat], view, les["id"],
                                       "mass" if les["type"] == "mass" else "calcification",
                                       *extra, les["assessment"], les["pathology"],
                                       les["subtlety"], csv_img, csv_crop, csv_mask]))
            boxes = [t["bbox"] for t in les_truth if t["malignant"]]
            exam_rows.append([anon, exam_id, rel_path, lat, view, int(cancer), annotation,
                              json.dumps(boxes if annotation == "full" else []), split])
            truth.append({
                "path": rel_path, "patient": p, "anon_patient": anon, "exam_id": exam_id,
                "laterality": lat, "view": view, "split": split, "cbis_folder": folder,
                "rows": rows, "cols": cols, "photometric": photometric, "bits_stored": b,
                "transfer_syntax": str(JPEG2000Lossless if j2k[img_index]
                                       else ExplicitVRLittleEndian),
                "cancer_label": int(cancer), "annotation": annotation,
                "nipple_x": round(nipple_x, 2), "lesions": les_truth,
                "study_uid": study, "series_uid": series,
                "PatientName": raw_name, "PatientID": raw_mrn,
                "PatientBirthDate": info["PatientBirthDate"],
            })
    return truth, rows_csv, exam_rows


def _swap_roi_files(out_dir, lesion):
    """Make one lesion's ROI folder a swapped one (mask 1-1.dcm, crop 1-2.dcm), as written."""
    mask, crop = (os.path.join(out_dir, lesion[k]) for k in ("mask_path", "crop_path"))
    tmp = mask + ".swap"
    os.replace(mask, tmp)
    os.replace(crop, mask)
    os.replace(tmp, crop)
    lesion["mask_path"], lesion["crop_path"] = lesion["crop_path"], lesion["mask_path"]
    lesion["mask_swapped"] = True


def make_synthetic_dataset(out_dir, patients=12, image_size=(256, 160), lesion_rate=0.6,
                           malignant_fraction=0.5, test_fraction=0.25, seed=0,
                           monochrome1_fraction=0.15, jpeg2000_fraction=0.15, progress=True,
                           truth_path=None, swap_fraction=0.1, separation=1.0,
                           size_scale=1.0, size_spread=1.0, size_sigma=0.0, contrast_scale=1.0,
                           texture_beta=3.0, texture_strength=0.0, vessels=0.0,
                           vessel_calc_fraction=0.0, benign_per_breast=0.0,
                           summations_per_view=0.0, workers=1):
    """Generates the dataset under ``out_dir``; returns a summary dict (see module doc).
    ``workers`` > 1 writes patients in that many processes; the files are the same.

    ``image_size`` = (rows, cols) of the original mammograms. The summary's ``truth`` lists every
    mammogram: path (relative to ``out_dir``), patient ids (CBIS ``P_xxxxx`` and exam-CSV
    ``anon_xxxxx``), laterality, view, split, label, raw identifiers written into the DICOM
    (so tests can check they never leak), and lesions with ROI files, pathology and bbox.
    ``truth_path`` (outside the dataset folder) optionally receives the summary as JSON.
    ``separation``: how far malignant and benign lesions differ (see plan.sample_lesion).
    ``size_scale`` / ``size_spread``: lesion diameters for development sets (plan._resize);
    the defaults leave the data byte-identical.

    Options for harder regimes (synthetic_mammo/regimes.py; every default leaves the data
    byte-identical): ``size_sigma`` log-normal lesion diameters (plan._resize),
    ``contrast_scale`` lesion contrast factor, ``texture_strength`` amplitude of a 1/f^beta
    anatomical texture (``texture_beta``), ``vessels`` mean number of crossing vessels per view
    of which ``vessel_calc_fraction`` carry vascular calcifications, ``benign_per_breast`` mean
    number of extra benign masses / calcification clusters per breast (listed like any lesion),
    ``summations_per_view`` mean number per view of tissue-superposition look-alikes: drawn like
    malignant masses, in one view only, not findings (plan.summation_lookalikes; their own
    generator ``[seed, 5, i]``).
    Their draws come from a generator of their own (patient ``i``: ``[seed, 4, i]``), so the
    planned lesions keep their places and pixels underneath.
    """
    from tqdm import tqdm

    rows, cols = int(image_size[0]), int(image_size[1])
    out_dir = os.path.abspath(out_dir)
    tree = os.path.join(out_dir, "CBIS-DDSM")
    os.makedirs(tree, exist_ok=True)
    plan = plan_patients(np.random.default_rng([seed, 1]), patients, lesion_rate,
                         malignant_fraction, test_fraction)
    mono1, j2k, bits = _encoding_quirks(np.random.default_rng([seed, 2]), 4 * patients, rows,
                                        cols, monochrome1_fraction, jpeg2000_fraction)

    size = dict(separation=separation, size_scale=size_scale, size_spread=size_spread,
                size_sigma=size_sigma, contrast_scale=contrast_scale)
    anatomy = {"texture_beta": texture_beta, "texture_strength": texture_strength,
               "vessels": vessels, "vessel_calc_fraction": vessel_calc_fraction}
    harder = (texture_strength > 0 or vessels > 0 or benign_per_breast > 0
              or summations_per_view > 0)
    write_patient = functools.partial(
        _write_patient, seed=seed, rows=rows, cols=cols, out_dir=out_dir, tree=tree, size=size,
        anatomy=anatomy, harder=harder, benign_per_breast=benign_per_breast,
        summations_per_view=summations_per_view,
        swap_fraction=swap_fraction, mono1=mono1, j2k=j2k, bits=bits)
    truth, rows_csv, exam_rows = [], {}, []
    swapped = 0
    abn_count = 0
    with ProcessPoolExecutor(workers) if workers > 1 else contextlib.nullcontext() as pool:
        parts = (pool.map if pool else map)(write_patient, plan)
        for p_truth, p_rows, p_exams in tqdm(parts, total=len(plan), desc="synthetic patients",
                                             disable=not progress):
            for lesion in (les for t in p_truth for les in t["lesions"]):
                abn_count += 1
                # the dataset's 2nd ROI folder is always swapped, so that even tiny datasets
                # exercise the quirk
                if swap_fraction > 0 and abn_count == 2 and not lesion["mask_swapped"]:
                    _swap_roi_files(out_dir, lesion)
                swapped += lesion["mask_swapped"]
            truth += p_truth
            exam_rows += p_exams
            for key, row in p_rows:
                rows_csv.setdefault(key, []).append(row)
    _write_csvs(out_dir, rows_csv, exam_rows)
    summary = _summary(out_dir, seed, rows, cols, truth, rows_csv, abn_count, swapped)
    # the settings, so that a truth file says which data it describes
    summary["generator"] = dict(size, **{k: v for k, v in anatomy.items()},
                                benign_per_breast=benign_per_breast,
                                summations_per_view=summations_per_view, lesion_rate=lesion_rate,
                                malignant_fraction=malignant_fraction, patients=patients)
    if truth_path:
        os.makedirs(os.path.dirname(os.path.abspath(truth_path)), exist_ok=True)
        with open(truth_path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def _write_csvs(out_dir, rows_csv, exam_rows):
    """The four CBIS case-description CSVs (``rows_csv``: (kind, split) -> rows) and exams.csv."""
    for kind, header in (("mass", MASS_HEADER), ("calc", CALC_HEADER)):
        for split in ("train", "test"):
            path = os.path.join(out_dir, f"{kind}_case_description_{split}_set.csv")
            with open(path, "w", newline="") as f:
                w = csv.writer(f, lineterminator="\n")
                w.writerow(header)
                w.writerows(rows_csv.get((kind, split), []))
    with open(os.path.join(out_dir, "exams.csv"), "w", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(EXAM_HEADER)
        w.writerows(exam_rows)


def _summary(out_dir, seed, rows, cols, truth, rows_csv, abn_count, swapped):
    """The dict make_synthetic_dataset returns: counts overall and per split, plus ``truth``."""
    def _count(split):
        ims = [t for t in truth if split in (None, t["split"])]
        return {"patients": len({t["patient"] for t in ims}), "images": len(ims),
                "malignant_images": sum(t["cancer_label"] for t in ims),
                "lesion_images": sum(bool(t["lesions"]) for t in ims)}

    return {
        "root": out_dir, "seed": seed, "image_size": [rows, cols],
        **_count(None),
        "abnormalities": abn_count,
        "mass_rows": sum(len(v) for (k, _), v in rows_csv.items() if k == "mass"),
        "calc_rows": sum(len(v) for (k, _), v in rows_csv.items() if k == "calc"),
        "splits": {s: _count(s) for s in ("train", "test")},
        "monochrome1": int(sum(t["photometric"] == "MONOCHROME1" for t in truth)),
        "jpeg2000": int(sum(t["transfer_syntax"] == str(JPEG2000Lossless) for t in truth)),
        "swapped_masks": int(swapped),
        "truth": truth,
    }
