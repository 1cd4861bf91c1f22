"""Synthetic CBIS-DDSM-style generator: layout, DICOM validity, ROI/truth agreement, determinism."""
import csv
import glob
import hashlib
import json
import os

import cv2
import numpy as np
import pydicom
import pytest
from pydicom.uid import JPEG2000Lossless
from synthetic_mammo import CALC_HEADER, EXAM_HEADER, MASS_HEADER, make_synthetic_dataset

CSV_NAMES = [
    f"{k}_case_description_{s}_set.csv" for k in ("mass", "calc") for s in ("train", "test")
]
PREFIXES = ("Mass-Training", "Calc-Training", "Mass-Test", "Calc-Test")
REQUIRED_TAGS = [
    "Modality", "ViewPosition", "ImageLaterality", "PatientID", "PatientName", "PatientBirthDate",
    "StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID", "SOPClassUID",
    "PresentationIntentType", "WindowCenter", "WindowWidth", "BitsAllocated", "BitsStored",
    "PhotometricInterpretation", "Rows", "Columns",
]


def _read_csv(path):
    with open(path, newline="") as f:
        return list(csv.reader(f))


def _cbis_rows(root):
    out = []
    for name in CSV_NAMES:
        rows = _read_csv(os.path.join(root, name))
        out += [dict(zip(rows[0], r)) for r in rows[1:]]
    return out


def _tree_file(root, csv_path, name):
    """CSV cell (.../000000.dcm, maybe with trailing whitespace) -> file in the download tree."""
    folder = os.path.dirname(csv_path.strip())
    return os.path.join(root, "CBIS-DDSM", folder, name)


def _mask_and_crop(root, csv_row):
    """Finds the mask among 1-1/1-2 the robust way: full-image size and only 0/255 values."""
    files = [_tree_file(root, csv_row["ROI mask file path"], n) for n in ("1-1.dcm", "1-2.dcm")]
    arrs = [pydicom.dcmread(f).pixel_array for f in files]
    is_mask = [set(np.unique(a).tolist()) <= {0, 255} and a.dtype == np.uint8 for a in arrs]
    assert sum(is_mask) == 1, files
    k = is_mask.index(True)
    return files[k], arrs[k], arrs[1 - k]


def _component_bbox(mask):
    n, _, stats, _ = cv2.connectedComponentsWithStats((mask > 0).astype(np.uint8), connectivity=8)
    assert n == 2, f"expected one connected component, got {n - 1}"
    x, y, w, h = stats[1, :4]
    return [int(x), int(y), int(x + w), int(y + h)]


def test_layout_and_headers(synthetic_root):
    root = synthetic_root.root
    assert sorted(os.listdir(root)) == sorted(CSV_NAMES + ["exams.csv", "CBIS-DDSM"])
    for name in CSV_NAMES:
        header = _read_csv(os.path.join(root, name))[0]
        assert header == (MASS_HEADER if name.startswith("mass") else CALC_HEADER)
    assert ",".join(MASS_HEADER).startswith("patient_id,breast_density,left or right breast")
    assert "breast density" in CALC_HEADER and "calc type" in CALC_HEADER
    rows = _cbis_rows(root)
    assert len(rows) == synthetic_root.summary["abnormalities"]
    quirky = 0
    for r in rows:
        assert r["left or right breast"] in ("LEFT", "RIGHT") and r["image view"] in ("CC", "MLO")
        assert r["pathology"] in ("MALIGNANT", "BENIGN", "BENIGN_WITHOUT_CALLBACK")
        assert r["patient_id"].startswith("P_") and len(r["patient_id"]) == 7
        img = r["image file path"]
        quirky += img != img.strip() or r["ROI mask file path"] != r["ROI mask file path"].strip()
        quirky += r["cropped image file path"] != r["cropped image file path"].strip()
        assert img.strip().endswith("/000000.dcm")
        assert r["ROI mask file path"].strip().endswith("/000001.dcm")
        folder = img.split("/")[0]
        assert folder.split("_P_")[0] in PREFIXES
        assert r["cropped image file path"].split("/")[0] == f"{folder}_{r['abnormality id']}"
        # CSV names 000000.dcm, the tree has 1-1.dcm (upstream quirk)
        assert not os.path.exists(os.path.join(root, "CBIS-DDSM", img.strip()))
        assert os.path.isfile(_tree_file(root, img, "1-1.dcm"))
    assert quirky >= 1


def test_every_dicom_reads_with_tags(synthetic_root):
    files = glob.glob(os.path.join(synthetic_root.root, "CBIS-DDSM", "**", "*.dcm"),
                      recursive=True)
    s = synthetic_root.summary
    assert len(files) == s["images"] + 2 * s["abnormalities"]
    for f in files:
        ds = pydicom.dcmread(f)
        for tag in REQUIRED_TAGS:
            assert tag in ds, (f, tag)
        assert ds.Modality == "MG" and ds.PresentationIntentType == "FOR PRESENTATION"
        assert ds.file_meta.TransferSyntaxUID in (pydicom.uid.ExplicitVRLittleEndian,
                                                  JPEG2000Lossless)
        # a hospital-style MRN that never appears in paths (so leaks are detectable)
        assert ds.PatientID.startswith("MRN") and ds.PatientID not in f
        a = ds.pixel_array
        assert a.shape == (ds.Rows, ds.Columns) and int(a.max()) < (1 << ds.BitsStored)


def test_jpeg2000_and_monochrome1(synthetic_root):
    root, truth = synthetic_root.root, synthetic_root.summary["truth"]
    j2k = [t for t in truth if t["transfer_syntax"] == str(JPEG2000Lossless)]
    mono1 = [t for t in truth if t["photometric"] == "MONOCHROME1"]
    assert j2k and mono1
    for t in j2k:
        ds = pydicom.dcmread(os.path.join(root, t["path"]))
        assert ds.file_meta.TransferSyntaxUID == JPEG2000Lossless
        a = ds.pixel_array
        assert a.shape == (t["rows"], t["cols"]) and a.dtype == np.uint16 and a.max() > 0
    for t in mono1:
        ds = pydicom.dcmread(os.path.join(root, t["path"]))
        assert ds.PhotometricInterpretation == "MONOCHROME1"
        a = ds.pixel_array.astype(np.int64)
        maxval = (1 << ds.BitsStored) - 1
        # background is dark after inversion: stored values near maxval dominate
        assert np.median(maxval - a[:, :8] if t["laterality"] == "R" else maxval - a[:, -8:]) \
            < 0.15 * maxval


def test_jpeg2000_is_lossless(tmp_path):
    from synthetic_mammo.write import _write_dicom

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 4096, size=(48, 40), dtype=np.uint16)
    info = dict(study_uid="1.2.3", series_uid="1.2.3.4", PatientName="X^Y", PatientID="P",
                PatientBirthDate="19500101", StudyDate="20000101", laterality="L", view="CC")
    _write_dicom(str(tmp_path / "a.dcm"), arr, info=info, sop_uid="1.2.3.4.5",
                 bits_stored=12, jpeg2000=True)
    ds = pydicom.dcmread(str(tmp_path / "a.dcm"))
    assert ds.file_meta.TransferSyntaxUID == JPEG2000Lossless
    np.testing.assert_array_equal(ds.pixel_array, arr)


def test_roi_masks_match_truth(synthetic_root):
    root, s = synthetic_root.root, synthetic_root.summary
    by_folder = {t["cbis_folder"]: t for t in s["truth"]}
    rows = _cbis_rows(root)
    swapped = 0
    for r in rows:
        t = by_folder[r["image file path"].split("/")[0]]
        lesion = {les["abnormality_id"]: les for les in t["lesions"]}[int(r["abnormality id"])]
        assert lesion["pathology"] == r["pathology"]
        path, mask, crop = _mask_and_crop(root, r)
        assert mask.shape == (t["rows"], t["cols"])
        assert crop.shape[0] < t["rows"] and crop.shape[1] <= t["cols"]
        assert _component_bbox(mask) == lesion["bbox"]
        assert path == os.path.join(root, lesion["mask_path"])
        swapped += path.endswith("1-1.dcm")
        x0, y0, x1, y1 = lesion["bbox"]
        w = x1 - x0
        assert 0.04 * t["cols"] <= w <= 0.25 * t["cols"], (w, t["cols"])
    assert swapped == s["swapped_masks"] >= 1


def test_lesion_visible_and_side_convention(synthetic_root):
    root = synthetic_root.root
    for t in synthetic_root.summary["truth"][:12]:
        ds = pydicom.dcmread(os.path.join(root, t["path"]))
        a = ds.pixel_array.astype(np.float32) / ((1 << ds.BitsStored) - 1)
        if ds.PhotometricInterpretation == "MONOCHROME1":
            a = 1.0 - a
        third = t["cols"] // 3
        chest, nipple_side = (a[:, :third], a[:, -third:]) if t["laterality"] == "L" else \
            (a[:, -third:], a[:, :third])
        assert chest.mean() > nipple_side.mean() + 0.05  # chest wall on the laterality's side
        for les in t["lesions"]:
            x0, y0, x1, y1 = les["bbox"]
            assert a[y0:y1, x0:x1].max() > np.median(a[a > 0.15])


def test_cc_mlo_consistency(synthetic_root):
    truth = synthetic_root.summary["truth"]
    breasts = {}
    for t in truth:
        breasts.setdefault((t["patient"], t["laterality"]), {})[t["view"]] = t
    assert all(set(v) == {"CC", "MLO"} for v in breasts.values())
    n_checked = 0
    for views in breasts.values():
        cc, mlo = views["CC"], views["MLO"]
        assert cc["nipple_x"] == mlo["nipple_x"] and cc["cancer_label"] == mlo["cancer_label"]
        assert [les["lesion_id"] for les in cc["lesions"]] == \
            [les["lesion_id"] for les in mlo["lesions"]]
        for a, b in zip(cc["lesions"], mlo["lesions"]):
            assert a["pathology"] == b["pathology"] and a["type"] == b["type"]
            assert abs(a["depth"] - b["depth"]) <= 0.02 * cc["cols"] + 1
            # depth from the bbox centres too (mask-derived, not just the recorded number)
            ca = abs((a["bbox"][0] + a["bbox"][2]) / 2 - cc["nipple_x"])
            cb = abs((b["bbox"][0] + b["bbox"][2]) / 2 - mlo["nipple_x"])
            assert abs(ca - cb) <= 0.12 * cc["cols"]
            n_checked += 1
    assert n_checked >= 4
    assert any(not v["CC"]["lesions"] for v in breasts.values())  # lesion-free breasts exist


def test_exams_csv(synthetic_root):
    root, s = synthetic_root.root, synthetic_root.summary
    rows = _read_csv(os.path.join(root, "exams.csv"))
    assert rows[0] == EXAM_HEADER
    recs = [dict(zip(rows[0], r)) for r in rows[1:]]
    assert len(recs) == s["images"] == 4 * s["patients"]
    cbis_ids = {t["patient"] for t in s["truth"]}
    by_path = {t["path"]: t for t in s["truth"]}
    for r in recs:
        assert os.path.isfile(os.path.join(root, r["image_path"]))
        assert r["patient_id"].startswith("anon_") and r["patient_id"] not in cbis_ids
        t = by_path[r["image_path"]]
        boxes = json.loads(r["boxes"])
        assert r["laterality"] == t["laterality"] and r["view"] == t["view"]
        assert int(r["cancer_label"]) == t["cancer_label"] and r["split"] == t["split"]
        if r["annotation"] == "weak":
            assert boxes == [] and r["cancer_label"] == "1"
        else:
            assert boxes == [les["bbox"] for les in t["lesions"] if les["malignant"]]
        assert r["cancer_label"] == "0" or r["annotation"] == "weak" or boxes
    assert {r["annotation"] for r in recs if r["cancer_label"] == "1"} <= {"full", "weak"}
    assert all(r["annotation"] == "full" for r in recs if r["cancer_label"] == "0")
    n_train = sum(r["split"] == "train" for r in recs)
    assert n_train == s["splits"]["train"]["images"]
    # lesion-free images are in the tree and exams.csv, never in the CBIS CSVs
    cbis_folders = {r["image file path"].split("/")[0] for r in _cbis_rows(root)}
    normal = [t for t in s["truth"] if not t["lesions"]]
    assert normal and all(t["cbis_folder"] not in cbis_folders for t in normal)


def test_no_identifier_in_csvs(synthetic_root):
    root, truth = synthetic_root.root, synthetic_root.summary["truth"]
    text = "".join(open(os.path.join(root, n)).read() for n in CSV_NAMES + ["exams.csv"])
    for t in truth:
        assert t["PatientName"] not in text and t["PatientBirthDate"] not in text


def _digest(root):
    h = hashlib.sha256()
    for name in sorted(CSV_NAMES + ["exams.csv"]):
        h.update(open(os.path.join(root, name), "rb").read())
    for f in sorted(glob.glob(os.path.join(root, "CBIS-DDSM", "**", "*.dcm"), recursive=True)):
        h.update(os.path.relpath(f, root).encode())
        h.update(pydicom.dcmread(f).pixel_array.tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("seeds,same", [((3, 3), True), ((3, 4), False)])
def test_determinism(tmp_path, seeds, same):
    kw = dict(patients=3, image_size=(96, 64), progress=False)
    a = make_synthetic_dataset(str(tmp_path / "a"), seed=seeds[0], **kw)
    b = make_synthetic_dataset(str(tmp_path / "b"), seed=seeds[1], **kw)
    assert (_digest(a["root"]) == _digest(b["root"])) is same
    strip = lambda s: {k: v for k, v in s.items() if k != "root"}
    assert (strip(a) == strip(b)) is same


def test_truth_path_outside_dataset(tmp_path):
    s = make_synthetic_dataset(str(tmp_path / "d"), patients=2, image_size=(96, 64),
                               progress=False, truth_path=str(tmp_path / "truth.json"))
    assert json.load(open(tmp_path / "truth.json"))["images"] == s["images"] == 8
    assert "truth.json" not in os.listdir(tmp_path / "d")


@pytest.mark.parametrize("kind,lo,hi", [("mass", 0.06, 0.11), ("calc", 0.07, 0.13)])
def test_lesion_size_parameters_keep_draws(kind, lo, hi):
    from synthetic_mammo.plan import sample_lesion

    def draw(**kw):
        return sample_lesion(np.random.default_rng(5), kind, True, 200, 2.0, **kw)

    base = draw()
    assert draw(size_scale=1.0, size_spread=1.0) == base  # defaults: the demo's data unchanged
    frac, centre = 2 * base["radius"] / 200, (lo + hi) / 2
    small, wide = draw(size_scale=0.5), draw(size_spread=2.0)
    assert 2 * small["radius"] / 200 == pytest.approx(0.5 * frac)
    assert 2 * wide["radius"] / 200 == pytest.approx(centre + 2 * (frac - centre))
    same = lambda les: {k: v for k, v in les.items() if k not in ("radius", "extent")}
    assert same(small) == same(base) == same(wide)  # same random draws whatever the sizes


# ---------------------------------------------------------------- harder regimes (issue 27)
# sha256 of the five CSVs of make_synthetic_dataset(patients=3, image_size=(96, 64), seed=3),
# computed before the harder-regime options existed: the defaults must not move a lesion, box,
# label or path (the demo's data; its pixels were compared byte for byte when they were added)
DEFAULT_CSV_SHA256 = "63c043a1f94a4ff661c4f68de253c60d0001d41e281f6501055a5ac15b6a67eb"
HARDER = dict(texture_strength=0.05, vessels=2.0, vessel_calc_fraction=0.5,
              benign_per_breast=1.0)


def _csv_digest(root):
    h = hashlib.sha256()
    for name in CSV_NAMES + ["exams.csv"]:
        h.update(open(os.path.join(root, name), "rb").read())
    return h.hexdigest()


def _pixels(root, truth):
    return {t["path"]: pydicom.dcmread(os.path.join(root, t["path"])).pixel_array
            for t in truth}


def test_defaults_pinned_and_harder_options_keep_planned_lesions(tmp_path):
    kw = dict(patients=3, image_size=(96, 64), seed=3, progress=False)
    base = make_synthetic_dataset(str(tmp_path / "base"), **kw)
    assert _csv_digest(base["root"]) == DEFAULT_CSV_SHA256
    off = make_synthetic_dataset(str(tmp_path / "off"), texture_strength=0.0, vessels=0.0,
                                 benign_per_breast=0.0, size_sigma=0.0, contrast_scale=1.0, **kw)
    assert _digest(off["root"]) == _digest(base["root"])  # options off: byte-identical
    hard = make_synthetic_dataset(str(tmp_path / "hard"), **HARDER, **kw)
    assert hard["generator"]["benign_per_breast"] == 1.0
    # the planned lesions keep their boxes and labels (own generator for the options) ...
    planned = lambda s: [(t["patient"], t["laterality"], t["view"], t["cancer_label"],
                          t["annotation"],
                          [(x["bbox"], x["pathology"]) for x in t["lesions"]][:n])
                         for t, n in zip(s["truth"], [len(t["lesions"]) for t in base["truth"]])]
    assert planned(hard) == planned(base)
    # ... the extra findings are benign, and every image's pixels changed (texture, vessels)
    extra = [x for t, b in zip(hard["truth"], base["truth"])
             for x in t["lesions"][len(b["lesions"]):]]
    assert extra and not any(x["malignant"] for x in extra)
    a, b = _pixels(base["root"], base["truth"]), _pixels(hard["root"], hard["truth"])
    assert all(not np.array_equal(x, y) for x, y in zip(a.values(), b.values()))


def test_workers_write_the_same_dataset(tmp_path):
    """workers=2 (patients in two processes; what make_regime uses for 1,300 patients) writes
    the same files, pixels, CSVs and truth as one process, harder options included; the
    dataset's 2nd ROI folder is swapped even when no draw swaps one (the parent renames its
    files: only it knows the order), with the mask then at 1-1.dcm."""
    kw = dict(patients=4, image_size=(96, 64), seed=3, progress=False, swap_fraction=1e-9,
              **HARDER)
    one = make_synthetic_dataset(str(tmp_path / "one"), **kw)
    two = make_synthetic_dataset(str(tmp_path / "two"), workers=2, **kw)
    assert _digest(one["root"]) == _digest(two["root"])
    strip = lambda s: {k: v for k, v in s.items() if k != "root"}
    assert strip(one) == strip(two)
    lesions = [x for t in two["truth"] for x in t["lesions"]]
    assert two["swapped_masks"] == 1 and [x["mask_swapped"] for x in lesions[:3]] == [
        False, True, False]
    mask = pydicom.dcmread(os.path.join(two["root"], lesions[1]["mask_path"])).pixel_array
    assert lesions[1]["mask_path"].endswith("1-1.dcm") and set(np.unique(mask)) == {0, 255}


@pytest.mark.parametrize("beta", [2.0, 3.0])
def test_power_law_texture_spectrum_slope(beta):
    from synthetic_mammo.render import power_law_noise

    n = power_law_noise(np.random.default_rng(0), (256, 256), beta)
    assert abs(float(n.mean())) < 1e-4 and float(n.std()) == pytest.approx(1.0, abs=1e-3)
    power = np.abs(np.fft.fft2(n)) ** 2
    f = np.hypot(*np.meshgrid(np.fft.fftfreq(256), np.fft.fftfreq(256), indexing="ij"))
    edges = np.geomspace(2 / 256, 0.45, 16)  # radially averaged spectrum in log-spaced rings
    idx = np.digitize(f.ravel(), edges)
    ring_f = [f.ravel()[idx == k].mean() for k in range(1, len(edges))]
    ring_p = [power.ravel()[idx == k].mean() for k in range(1, len(edges))]
    slope = np.polyfit(np.log(ring_f), np.log(ring_p), 1)[0]
    assert slope == pytest.approx(-beta, abs=0.15)


def test_vessels_are_long_thin_and_may_carry_calcifications():
    from synthetic_mammo.render import render_vessels

    rows, cols = 256, 128
    geo = {"a": 90.0, "cc_b": 100.0, "cc_cy": 128.0}
    breast = np.ones((rows, cols), bool)
    for seed in range(3):
        img = np.zeros((rows, cols), np.float32)
        dens = render_vessels(np.random.default_rng(seed), img, breast, geo, "CC", 1, 0.0, cols)
        assert np.array_equal(img, dens) and dens.max() > 0.02
        pts = np.argwhere(dens > 0.25 * dens.max())
        length = np.ptp(pts[:, 0]) + np.ptp(pts[:, 1])  # >= the curve's span
        assert length > 0.5 * cols  # long ...
        assert len(pts) / length < 0.05 * cols  # ... and thin: area / length ~ its width
    calc = np.zeros((rows, cols), np.float32)
    render_vessels(np.random.default_rng(0), calc, breast, geo, "CC", 1, 1.0, cols)
    plain = render_vessels(np.random.default_rng(0), np.zeros_like(calc), breast, geo, "CC",
                           1, 0.0, cols)
    assert calc.max() > plain.max() + 0.05  # bright tram-track dots on the vessel


@pytest.mark.parametrize("kind,lo,hi", [("mass", 0.06, 0.11), ("calc", 0.07, 0.13)])
def test_lognormal_sizes_and_contrast_scale_keep_draws(kind, lo, hi):
    from synthetic_mammo.plan import sample_lesion

    def draws(n, **kw):
        rng = np.random.default_rng(1)
        return [sample_lesion(rng, kind, True, 200, 1.5, **kw) for _ in range(n)]

    base, wide = draws(2000), draws(2000, size_scale=0.8, size_sigma=0.5, contrast_scale=0.5)
    diam = np.array([2 * w["radius"] / 200 for w in wide])
    assert np.median(diam) == pytest.approx(0.8 * (lo + hi) / 2, rel=0.05)
    assert np.log(diam).std() == pytest.approx(0.5, rel=0.08)  # log-normal spread
    for b, w in zip(base[:50], wide[:50]):
        assert w["contrast"] == pytest.approx(0.5 * b["contrast"])
        same = lambda les: {k: v for k, v in les.items()
                            if k not in ("radius", "extent", "contrast")}
        assert same(w) == same(b)  # same random draws whatever the options


def test_regimes_are_generator_settings():
    import inspect

    from synthetic_mammo import REGIMES, regime

    known = set(inspect.signature(make_synthetic_dataset).parameters)
    assert len(REGIMES) >= 2 and all(set(r) <= known for r in REGIMES.values())
    assert len({r["seed"] for r in REGIMES.values()}) == len(REGIMES)  # not one draw
    assert regime("benchmark_a", patients=5)["patients"] == 5
    with pytest.raises(ValueError, match="unknown regime"):
        regime("nope")
    with pytest.raises(ValueError, match="not a make_synthetic_dataset setting: contrast$"):
        regime("benchmark_a", contrast=0.5)


def test_summation_lookalikes_are_one_view_masses_clear_of_lesions():
    from synthetic_mammo.plan import summation_lookalikes

    rows, cols = 256, 128
    geo = {"a": 100.0, "cc_b": 110.0, "cc_cy": 128.0, "mlo_b": 110.0, "mlo_cy": 128.0}
    yy, xx = np.mgrid[:rows, :cols]
    allowed = {v: np.clip(60 - np.hypot(xx - 40, yy - 128), 0, None).astype(np.float32)
               for v in ("CC", "MLO")}
    lesion = {"_xy": {"CC": (40.0, 128.0), "MLO": (40.0, 100.0)}, "extent": 6.0}
    found = [summation_lookalikes(np.random.default_rng(s), 3.0, "CC", geo, allowed, [lesion],
                                  rows, cols) for s in range(20)]
    sums = [x for f in found for x in f]
    assert len(sums) > 20 and {len(f) for f in found} != {len(found[0])}  # a Poisson count
    for x in sums:
        assert x["type"] == "mass" and set(x["_xy"]) == {"CC"}  # one view only
        cx, cy = x["_xy"]["CC"]
        assert allowed["CC"][int(round(cy)), int(round(cx))] >= x["extent"] + 2  # in the breast
        assert np.hypot(cx - 40, cy - 128) >= x["extent"] + lesion["extent"] + 3  # clear of it


def test_summations_change_pixels_only(tmp_path):
    kw = dict(patients=4, image_size=(128, 80), seed=3, progress=False)
    base = make_synthetic_dataset(str(tmp_path / "base"), **kw)
    summ = make_synthetic_dataset(str(tmp_path / "summ"), summations_per_view=1.0, **kw)
    assert summ["generator"]["summations_per_view"] == 1.0
    assert summ["truth"] == base["truth"]  # not findings: every label, lesion and box kept
    assert _csv_digest(summ["root"]) == _csv_digest(base["root"])
    a, b = _pixels(base["root"], base["truth"]), _pixels(summ["root"], summ["truth"])
    changed = [not np.array_equal(a[k], b[k]) for k in a]
    assert 0 < sum(changed) < len(changed)  # Poisson(1) per view: some views have none
    # the same breast's two views get their own look-alikes: a changed view beside an
    # unchanged one happens (never with a lesion, which is in both views)
    by_breast = {}
    for t, c in zip(base["truth"], changed):
        by_breast.setdefault((t["patient"], t["laterality"]), []).append(c)
    assert any(len(set(v)) == 2 for v in by_breast.values())
