"""Synthetic screening-mammography dataset in the real CBIS-DDSM on-disk layout.

Used by the tests and the demo: everything (pixels, UIDs, CSVs) is deterministic from ``seed``.
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
"""
import csv
import datetime
import json
import os

import cv2
import numpy as np
from pydicom.dataset import Dataset, FileMetaDataset
from pydicom.uid import (
    PYDICOM_IMPLEMENTATION_UID,
    ExplicitVRLittleEndian,
    JPEG2000Lossless,
    generate_uid,
)

__all__ = ["make_synthetic_dataset", "MASS_HEADER", "CALC_HEADER", "EXAM_HEADER"]

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
VIEWS = ("CC", "MLO")
SIDES = {"L": "LEFT", "R": "RIGHT"}


# ----------------------------------------------------------------------------- rendering
def _smooth_noise(rng, shape, sigma):
    """Gaussian-filtered white noise, normalised to zero mean / unit std."""
    n = rng.standard_normal(shape).astype(np.float32)
    n = cv2.GaussianBlur(n, (0, 0), sigmaX=max(sigma, 0.3))
    return (n - n.mean()) / (n.std() + 1e-6)


def _breast_geometry(rng, rows, cols):
    """Per-breast geometry shared by both views (same depth axis => consistent lesion depth)."""
    return {
        "a": float(rng.uniform(0.62, 0.76) * cols),  # chest wall -> nipple distance (px)
        "cc_b": float(rng.uniform(0.36, 0.43) * rows),
        "cc_cy": float(rng.uniform(0.47, 0.53) * rows),
        "mlo_b": float(rng.uniform(0.50, 0.56) * rows),
        "mlo_cy": float(rng.uniform(0.50, 0.56) * rows),
        "pect_w": float(rng.uniform(0.22, 0.36) * cols),
        "pect_h": float(rng.uniform(0.35, 0.50) * rows),
    }


def _breast_masks(geo, view, rows, cols):
    """Breast and pectoral masks in the left-laterality frame (chest wall at x = 0)."""
    yy, xx = np.mgrid[0:rows, 0:cols].astype(np.float32)
    b, cy = (geo["cc_b"], geo["cc_cy"]) if view == "CC" else (geo["mlo_b"], geo["mlo_cy"])
    breast = (xx / geo["a"]) ** 2 + ((yy - cy) / b) ** 2 <= 1.0
    pect = np.zeros_like(breast)
    if view == "MLO":
        pect = (xx / geo["pect_w"] + yy / geo["pect_h"]) <= 1.0
        breast |= pect
    return breast, pect


def _radial_strands(rng, nipple, shape, cols):
    """Fibrous strands converging on the nipple: noise smeared along rays, mapped to the image."""
    rows = shape[0]
    n_t, n_r = 360, int(np.hypot(rows, cols)) + 2
    polar = rng.standard_normal((n_t, n_r)).astype(np.float32)
    polar = cv2.blur(polar, (max(3, int(0.15 * cols) | 1), 1))  # along the ray (radius axis)
    polar = cv2.GaussianBlur(polar, (0, 0), sigmaX=0.5, sigmaY=0.8)
    yy, xx = np.mgrid[0:rows, 0:cols].astype(np.float32)
    dx, dy = xx - nipple[0], yy - nipple[1]
    map_r = np.sqrt(dx * dx + dy * dy)
    map_t = (np.arctan2(dy, dx) + np.pi) * (n_t / (2 * np.pi))
    out = cv2.remap(polar, map_r, np.minimum(map_t, n_t - 1.001), cv2.INTER_LINEAR)
    return out / (out.std() + 1e-6)


def _render_tissue(rng, breast, pect, density, geo, view, cols):
    """Fat/glandular texture with fibrous strands, skin falloff and skin line; background 0."""
    rows = breast.shape[0]
    dist = cv2.distanceTransform(breast.astype(np.uint8), cv2.DIST_L2, 3)
    # glandular islands: low-pass noise through a soft threshold, sparse near the skin
    small = (max(8, rows // 4), max(8, cols // 4))  # blur at 1/4 resolution (speed)
    g = _smooth_noise(rng, small, 0.05 * small[1])
    g = cv2.resize(g, (cols, rows), interpolation=cv2.INTER_CUBIC)
    inner = np.clip(dist / (0.22 * cols), 0.0, 1.0)
    gland = 1.0 / (1.0 + np.exp(-(1.6 * g - (2.0 - 0.55 * density) + 1.2 * inner)))
    gland *= inner ** 0.5
    cy = geo["cc_cy"] if view == "CC" else geo["mlo_cy"]
    fib = _radial_strands(rng, (geo["a"], cy), (rows, cols), cols)
    fine = _smooth_noise(rng, (rows, cols), 0.8)
    fat = 0.28 + 0.03 * cv2.resize(_smooth_noise(rng, small, 0.08 * small[1]), (cols, rows))
    tissue = fat + (0.10 + 0.06 * density) * gland + (0.015 + 0.01 * gland) * fib + 0.012 * fine
    falloff = np.clip(dist / max(2.0, 0.08 * cols), 0.0, 1.0)
    tissue = tissue * (0.55 + 0.45 * falloff)  # thinner compressed tissue near the skin
    skin = (dist > 0) & (dist <= max(1.0, 0.012 * cols))
    tissue = tissue + 0.06 * skin
    if pect.any():  # pectoral muscle: bright, fairly homogeneous, brighter towards the corner
        yy, xx = np.mgrid[0:rows, 0:cols].astype(np.float32)
        t = np.clip(1.0 - (xx / geo["pect_w"] + yy / geo["pect_h"]), 0.0, 1.0)
        muscle = 0.55 + 0.12 * t + 0.02 * fine + 0.01 * fib
        pm = cv2.GaussianBlur(pect.astype(np.float32), (0, 0), max(0.6, 0.006 * cols))
        tissue = pm * muscle + (1.0 - pm) * tissue
    img = np.where(breast, tissue, 0.0).astype(np.float32)
    return img, dist


def _largest_component(mask):
    n, lab, stats, _ = cv2.connectedComponentsWithStats(mask.astype(np.uint8), connectivity=8)
    if n <= 2:
        return mask.astype(bool)
    k = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    return lab == k


def _mass_mask(rng, lesion, center, shape):
    """Filled polygon: smooth low-frequency contour, plus spikes for spiculated masses."""
    R, n = lesion["radius"], 96
    theta = np.linspace(0, 2 * np.pi, n, endpoint=False)
    r = np.ones(n)
    for k in range(2, 6):
        r += lesion["irregularity"] / k * np.cos(k * theta + rng.uniform(0, 2 * np.pi))
    for _ in range(lesion["spikes"]):
        j = int(rng.integers(n))
        length = rng.uniform(1.35, 1.75)
        for dj, f in ((-1, 0.55), (0, 1.0), (1, 0.55)):
            r[(j + dj) % n] = max(r[(j + dj) % n], 1.0 + (length - 1.0) * f)
    r *= R
    pts = np.stack([center[0] + r * np.cos(theta), center[1] + r * np.sin(theta)], 1)
    m = np.zeros(shape, np.uint8)
    cv2.fillPoly(m, [np.round(pts * 16).astype(np.int32)], 1, cv2.LINE_8, shift=4)
    return _largest_component(m)


def _calc_dots(rng, lesion, center, cols):
    """Tiny bright dots: malignant clusters tighter and pleomorphic (varied size/elongation)."""
    n, spread = lesion["n_dots"], lesion["radius"]
    pts = rng.normal(0, spread * lesion["tightness"], size=(n, 2))
    pts = np.clip(pts, -spread, spread) + np.asarray(center)
    base = max(0.6, 0.0045 * cols)
    sizes = base * (1 + lesion["pleomorphism"] * rng.uniform(-0.5, 1.2, n))
    return pts, np.maximum(sizes, 0.5)


def _render_lesion(rng, img, lesion, center, cols):
    """Adds the lesion to ``img`` in place; returns its ROI mask (bool, one component)."""
    shape = img.shape
    if lesion["type"] == "mass":
        mask = _mass_mask(rng, lesion, center, shape)
        # denser centre than rim (distance profile), soft edge, spikes fainter than the body
        prof = cv2.distanceTransform(mask.astype(np.uint8), cv2.DIST_L2, 3)
        prof = np.clip(prof / max(1.0, 0.6 * lesion["radius"]), 0.0, 1.0)
        dens = cv2.GaussianBlur(0.35 * mask + 0.65 * prof, (0, 0), lesion["blur"])
        core = _smooth_noise(rng, shape, 0.6)
        img += dens * (lesion["contrast"] + 0.015 * core)
        return mask
    pts, sizes = _calc_dots(rng, lesion, center, cols)
    dots = np.zeros(shape, np.float32)
    for (x, y), s in zip(pts, sizes):
        ax = (int(round(s * 16)), int(round(s * 16 * (1 + lesion["pleomorphism"] * rng.uniform()))))
        cv2.ellipse(dots, (int(round(x * 16)), int(round(y * 16))), ax,
                    float(rng.uniform(0, 180)), 0, 360, 1.0, -1, cv2.LINE_AA, shift=4)
    dots = cv2.GaussianBlur(dots, (0, 0), 0.5)
    img += np.clip(dots * 1.6, 0, 1) * lesion["contrast"]
    hull = cv2.convexHull(np.round(pts).astype(np.int32))
    mask = np.zeros(shape, np.uint8)
    cv2.fillConvexPoly(mask, hull, 1)
    pad = int(np.ceil(sizes.max())) + 2
    mask = cv2.dilate(mask, cv2.getStructuringElement(cv2.MORPH_ELLIPSE, (2 * pad + 1,) * 2))
    return _largest_component(mask)


def _sample_lesion(rng, kind, malignant, cols):
    """Lesion parameters; malignant vs benign differ in distribution, with overlap."""
    if kind == "mass":
        spiculated = rng.uniform() < (0.7 if malignant else 0.2)
        diam = rng.uniform(0.06, 0.11) * cols
        les = {
            "type": "mass",
            "radius": diam / 2,
            "irregularity": float(rng.uniform(0.10, 0.35) if malignant else rng.uniform(0, 0.2)),
            "spikes": int(rng.integers(5, 11)) if spiculated else 0,
            "blur": float(rng.uniform(0.4, 1.2) if spiculated else rng.uniform(0.5, 2.0)),
            "contrast": float(np.clip(rng.normal(0.18 if malignant else 0.14, 0.05), 0.07, 0.35)),
        }
        irregular = les["irregularity"] > 0.2
        les["shape"] = ("IRREGULAR" if irregular else
                        str(rng.choice(["ROUND", "OVAL", "LOBULATED"])))
        les["margins"] = ("SPICULATED" if spiculated else
                          str(rng.choice(["CIRCUMSCRIBED", "OBSCURED", "ILL_DEFINED",
                                          "MICROLOBULATED"])))
        les["extent"] = les["radius"] * (1.8 if spiculated else 1 + les["irregularity"])
        return les
    diam = rng.uniform(0.07, 0.13) * cols
    les = {
        "type": "calc",
        "radius": diam / 2,
        "n_dots": int(rng.integers(8, 16) if malignant else rng.integers(4, 10)),
        "tightness": float(rng.uniform(0.3, 0.5) if malignant else rng.uniform(0.45, 0.7)),
        "pleomorphism": float(rng.uniform(0.5, 1.0) if malignant else rng.uniform(0.0, 0.6)),
        "contrast": float(np.clip(rng.normal(0.42 if malignant else 0.36, 0.06), 0.2, 0.6)),
    }
    les["calc_type"] = ("PLEOMORPHIC" if les["pleomorphism"] > 0.55 else
                        str(rng.choice(["PUNCTATE", "ROUND_AND_REGULAR", "AMORPHOUS"])))
    les["distribution"] = "CLUSTERED" if les["tightness"] < 0.5 else str(
        rng.choice(["CLUSTERED", "SEGMENTAL", "REGIONAL"]))
    les["extent"] = les["radius"] + max(1.0, 0.01 * cols) + 2
    return les


def _place_lesions(rng, lesions, geo, allowed, rows, cols):
    """Chooses, per lesion, one depth from the nipple and one vertical position per view.

    ``allowed[view]`` is the distance map (left frame) of breast minus pectoral muscle; the
    centre must be ``extent + margin`` inside it in BOTH views, and lesions must not overlap.
    """
    a = geo["a"]
    placed = []
    for les in lesions:
        for attempt in range(400):
            shrink = 1.0 if attempt < 300 else 0.7
            ext = les["extent"] * shrink
            depth = rng.uniform(0.2, 0.75) * a
            x = a - depth
            cs = {}
            for view in VIEWS:
                b, cy = (geo["cc_b"], geo["cc_cy"]) if view == "CC" else (geo["mlo_b"],
                                                                           geo["mlo_cy"])
                half = b * np.sqrt(max(0.0, 1 - (x / a) ** 2))
                y = cy + rng.uniform(-0.65, 0.65) * half
                xi, yi = int(round(x)), int(round(y))
                if not (0 <= yi < rows and 0 <= xi < cols) or allowed[view][yi, xi] < ext + 2:
                    break
                if any(np.hypot(x - p["_xy"][view][0], y - p["_xy"][view][1])
                       < ext + p["extent"] + 3 for p in placed):
                    break
                cs[view] = (float(x), float(y))
            if len(cs) == 2:
                if shrink != 1.0:
                    les["radius"] *= shrink
                    les["extent"] = ext
                les["_xy"], les["depth"] = cs, float(depth)
                placed.append(les)
                break
    return placed


def _burn_in_text(img, text, rows, cols, side):
    """Bright text label + marker square in the background on the nipple side (final frame)."""
    fs = 0.3 * cols / 96
    thick = max(1, int(round(cols / 200)))
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, fs, thick)
    scale = min(1.0, 0.3 * cols / max(tw, 1), 0.08 * rows / max(th + base, 1))
    fs *= scale
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, fs, thick)
    m = max(2, int(0.02 * cols))
    x0 = cols - m - tw if side == "L" else m  # nipple side
    canvas = np.zeros(img.shape, np.uint8)
    cv2.putText(canvas, text, (x0, m + th), cv2.FONT_HERSHEY_SIMPLEX, fs, 255, thick, cv2.LINE_AA)
    s = max(3, int(round(0.04 * cols)))
    mx = cols - m - s if side == "L" else m
    my = rows - m - s
    canvas[my:my + s, mx:mx + s] = 255
    img[:] = np.maximum(img, canvas.astype(np.float32) / 255.0 * 0.95)


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
def _plan_patients(rng, patients, lesion_rate, malignant_fraction, test_fraction):
    """Patient ids, splits and which breasts carry (malignant) lesions."""
    ids, pid = [], 0
    for _ in range(patients):
        pid += int(rng.integers(1, 4))  # sparse ids, like upstream
        ids.append(f"P_{pid:05d}")
    n_test = int(round(patients * test_fraction))
    if patients >= 2 and test_fraction > 0:
        n_test = min(max(n_test, 1), patients - 1)
    test_idx = set(rng.permutation(patients)[:n_test].tolist())
    plan = []
    for i, p in enumerate(ids):
        split = "test" if i in test_idx else "train"
        breasts = {}
        for lat in ("L", "R"):
            has = rng.uniform() < lesion_rate
            breasts[lat] = {
                "has_lesion": bool(has),
                "n": int(rng.choice([1, 1, 1, 2])) if has else 0,
                "malignant": [bool(rng.uniform() < malignant_fraction) for _ in range(2)],
                "kind": "mass" if rng.uniform() < 0.55 else "calc",
            }
        plan.append({"index": i, "patient": p, "split": split, "breasts": breasts})
    # Guarantee at least one malignant breast per non-empty split (tests/demo need positives).
    for split in ("train", "test"):
        members = [pl for pl in plan if pl["split"] == split]
        if malignant_fraction > 0 and lesion_rate > 0 and members and not any(
            b["has_lesion"] and any(b["malignant"][: b["n"]])
            for pl in members for b in pl["breasts"].values()
        ):
            b = members[0]["breasts"]["L"]
            b.update(has_lesion=True, n=max(1, b["n"]))
            b["malignant"][0] = True
    return plan


def make_synthetic_dataset(out_dir, patients=12, image_size=(256, 160), lesion_rate=0.6,
                           malignant_fraction=0.5, test_fraction=0.25, seed=0,
                           monochrome1_fraction=0.15, jpeg2000_fraction=0.15, progress=True,
                           truth_path=None, swap_fraction=0.1):
    """Generates the dataset under ``out_dir``; returns a summary dict (see module doc).

    ``image_size`` = (rows, cols) of the original mammograms. The summary's ``truth`` lists every
    mammogram: path (relative to ``out_dir``), patient ids (CBIS ``P_xxxxx`` and exam-CSV
    ``anon_xxxxx``), laterality, view, split, label, raw identifiers written into the DICOM
    (so tests can check they never leak), and lesions with ROI files, pathology and bbox.
    ``truth_path`` (outside the dataset folder) optionally receives the summary as JSON.
    """
    from tqdm import tqdm

    rows, cols = int(image_size[0]), int(image_size[1])
    out_dir = os.path.abspath(out_dir)
    tree = os.path.join(out_dir, "CBIS-DDSM")
    os.makedirs(tree, exist_ok=True)
    plan = _plan_patients(np.random.default_rng([seed, 1]), patients, lesion_rate,
                          malignant_fraction, test_fraction)
    n_images = 4 * patients
    # Per-image encoding quirks, fixed up-front; at least one of each when there are images.
    enc_rng = np.random.default_rng([seed, 2])
    mono1 = enc_rng.uniform(size=n_images) < monochrome1_fraction
    j2k = enc_rng.uniform(size=n_images) < jpeg2000_fraction
    if min(rows, cols) < 32:  # openjpeg cannot encode such tiny images
        jpeg2000_fraction, j2k[:] = 0.0, False
    if n_images >= 4:
        if monochrome1_fraction > 0 and not mono1.any():
            mono1[1] = True
        if jpeg2000_fraction > 0 and not j2k.any():
            j2k[2] = True
    bits = enc_rng.choice([12, 14, 16], size=n_images)

    truth, rows_csv, exam_rows = [], {}, []
    swapped = 0
    abn_count = 0
    for pl in tqdm(plan, desc="synthetic patients", disable=not progress):
        prng = np.random.default_rng([seed, 3, pl["index"]])
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
            geo = _breast_geometry(prng, rows, cols)
            masks = {v: _breast_masks(geo, v, rows, cols) for v in VIEWS}
            allowed = {}
            for v in VIEWS:
                free = masks[v][0] & ~cv2.dilate(masks[v][1].astype(np.uint8),
                                                 np.ones((3, 3), np.uint8)).astype(bool)
                allowed[v] = cv2.distanceTransform(free.astype(np.uint8), cv2.DIST_L2, 3)
            lesions = []
            for k in range(bp["n"]):
                lesions.append(_sample_lesion(prng, bp["kind"], bp["malignant"][k], cols))
            lesions = _place_lesions(prng, lesions, geo, allowed, rows, cols)
            kind = lesions[0]["type"] if lesions else "mass"
            prefix = f"{kind.capitalize()}-{stage}"
            for k, les in enumerate(lesions):
                les["id"] = k + 1
                mal = bp["malignant"][k]
                les["pathology"] = "MALIGNANT" if mal else str(
                    prng.choice(["BENIGN", "BENIGN", "BENIGN_WITHOUT_CALLBACK"]))
                les["assessment"] = int(prng.choice([4, 4, 5]) if mal else prng.choice([2, 3, 4]))
                les["subtlety"] = int(prng.integers(1, 6))
            cancer = any(les["pathology"] == "MALIGNANT" for les in lesions)
            # Both views of a cancer breast share the annotation level (full for ~1/3).
            annotation = "full" if (not cancer or prng.uniform() < 1 / 3) else "weak"
            for view in VIEWS:
                img_index = pl["index"] * 4 + (0 if lat == "L" else 2) + VIEWS.index(view)
                breast, pect = masks[view]
                img, _ = _render_tissue(prng, breast, pect, density, geo, view, cols)
                roi_masks = [_render_lesion(prng, img, les, les["_xy"][view], cols)
                             for les in lesions]
                img = np.where(breast, img, 0.0)
                bg = 0.03 + 0.012 * prng.standard_normal((rows, cols)).astype(np.float32)
                img = np.where(breast, img, np.clip(bg, 0, None))
                if lat == "R":  # chest wall on the right edge for right breasts
                    img = img[:, ::-1].copy()
                    roi_masks = [m[:, ::-1].copy() for m in roi_masks]
                _burn_in_text(img, f"{lat} {view}", rows, cols, lat)
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
                    abn_count += 1
                    rfolder = f"{folder}_{les['id']}"
                    rstudy, rseries = _uid(seed, rfolder, "study"), _uid(seed, rfolder, "series")
                    # ~swap_fraction of ROI folders swap mask/crop; the 2nd one always does,
                    # so even tiny datasets exercise the quirk.
                    swap = bool(prng.uniform() < swap_fraction) or (swap_fraction > 0
                                                                     and abn_count == 2)
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
                        "mask_swapped": swap,
                    })
                    swapped += swap
                    csv_img = f"{rel_dir}/000000.dcm"
                    csv_crop = f"{rfolder}/{rstudy}/{rseries}/000000.dcm"
                    csv_mask = f"{rfolder}/{rstudy}/{rseries}/000001.dcm"
                    q = prng.uniform()  # upstream whitespace quirks in path cells
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
                    rows_csv.setdefault(key, []).append(
                        [p, density, SIDES[lat], view, les["id"],
                         "mass" if les["type"] == "mass" else "calcification", *extra,
                         les["assessment"], les["pathology"], les["subtlety"],
                         csv_img, csv_crop, csv_mask])
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

    def _count(split):
        ims = [t for t in truth if split in (None, t["split"])]
        return {"patients": len({t["patient"] for t in ims}), "images": len(ims),
                "malignant_images": sum(t["cancer_label"] for t in ims),
                "lesion_images": sum(bool(t["lesions"]) for t in ims)}

    summary = {
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
    if truth_path:
        os.makedirs(os.path.dirname(os.path.abspath(truth_path)), exist_ok=True)
        with open(truth_path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary

