"""Hostile and broken inputs (issue #15): corrupted cache entries, crafted CSV cells, a second
run on a busy OUTPUT_DIR, checks before training, a full disk and refused checkpoints."""
import json
import logging
import os

import numpy as np
import pytest

from braixdet.data.preprocess import PreprocessParams

PARAMS = PreprocessParams(canonical_size=(128, 64), margin=0.02, downsample=4)


# ------------------------------------------------------------------------------ cache entries
def _dicom(path):
    from braixdet.data.dicom import write_dicom

    h, w = 300, 240
    yy, xx = np.mgrid[0:h, 0:w]
    r = np.hypot((yy - h * 0.55) / (0.38 * h), xx / (0.55 * w))
    img = np.where(r < 1, 0.45 + 0.35 * (1 - r), 0.03)
    img = img + np.random.default_rng(0).normal(0, 0.01, (h, w))
    pixels = (np.clip(img, 0, 1) * 4000).astype(np.uint16)
    return write_dicom(path, pixels, bits_stored=12, ImageLaterality="L")


def _flip_data_bytes(path):
    data = bytearray(open(path, "rb").read())
    for i in range(len(data) - 400, len(data) - 200):  # pixel data, the header stays intact
        data[i] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _drop_checksum(path):
    record = json.load(open(path))
    del record["image"]
    json.dump(record, open(path, "w"))


def _wrong_shape(path):
    np.save(path, np.zeros((64, 32), np.uint16), allow_pickle=False)


_CORRUPTIONS = {
    "npy_zero_bytes": (".npy", lambda p: open(p, "wb").close()),
    "npy_truncated": (".npy", lambda p: os.truncate(p, os.path.getsize(p) // 2)),
    "npy_data_flipped_header_intact": (".npy", _flip_data_bytes),
    "npy_wrong_shape": (".npy", _wrong_shape),
    "npy_missing": (".npy", os.remove),
    "sidecar_empty_object": (".json", lambda p: open(p, "w").write("{}")),
    "sidecar_empty_list": (".json", lambda p: open(p, "w").write("[]")),
    "sidecar_not_json": (".json", lambda p: open(p, "w").write("not json {")),
    "sidecar_deeply_nested": (".json", lambda p: open(p, "w").write("[" * 100_000)),
    "sidecar_without_checksum": (".json", _drop_checksum),
    "png_data_flipped": (".png", _flip_data_bytes),
    "png_zero_bytes": (".png", lambda p: open(p, "wb").close()),
}


@pytest.mark.parametrize("kind", sorted(_CORRUPTIONS))
def test_invalid_cache_entry_is_rebuilt_never_used(tmp_path, caplog, kind):
    from braixdet.data.cache import CanonicalCache

    ext, corrupt = _CORRUPTIONS[kind]
    fmt = "png" if ext == ".png" else "npy"
    dcm = _dicom(tmp_path / "a.dcm")
    cache = CanonicalCache(tmp_path / "cache", PARAMS, fmt=fmt)
    fresh, tfm = cache.get(dcm, "L")  # cold: a fresh decode
    stem = cache.entry_path(dcm, "L")
    corrupt(stem + ext)

    reader = CanonicalCache(tmp_path / "cache", PARAMS, fmt=fmt)  # e.g. the next run
    with caplog.at_level(logging.WARNING, logger="braixdet.data.cache"):
        img, tfm2 = reader.get(dcm, "L")
    assert np.array_equal(img, fresh)
    assert tfm2.transforms and len(tfm2.transforms) == len(tfm.transforms)
    assert reader.rebuilt == 1 and sum(reader.rebuilt_reasons.values()) == 1
    lines = [r.getMessage() for r in caplog.records if "rebuilt" in r.getMessage()]
    assert len(lines) == 1 and stem in lines[0] and "\n" not in lines[0], lines
    # the rebuilt entry is valid again: a plain hit
    img3, _ = reader.get(dcm, "L")
    assert np.array_equal(img3, fresh) and reader.rebuilt == 1


def test_valid_cache_entry_is_not_rebuilt(tmp_path):
    from braixdet.data.cache import CanonicalCache

    dcm = _dicom(tmp_path / "a.dcm")
    cache = CanonicalCache(tmp_path / "cache", PARAMS)
    first, _ = cache.get(dcm, "L")
    stem = cache.entry_path(dcm, "L")
    mtime = os.path.getmtime(stem + ".npy")
    again, _ = CanonicalCache(tmp_path / "cache", PARAMS).get(dcm, "L")
    assert np.array_equal(first, again) and os.path.getmtime(stem + ".npy") == mtime
    assert cache.rebuilt == 0


# ------------------------------------------------------------------------------ hostile CSV cells
_HOSTILE_BOXES = {
    "400_digit_number": json.dumps([[1, 2, 3, 4]]).replace("3", "9" * 400),
    "nesting_depth_10000": "[" * 10_000 + "]" * 10_000,
    "json_true": "[[true, 2, 30, 40]]",
    "json_NaN": "[[NaN, 2, 30, 40]]",
    "json_Infinity": "[[1, 2, Infinity, 40]]",
    "1e999": "[[1, 2, 1e999, 40]]",
    "huge_magnitude": "[[1, 2, 3e7, 40]]",
    "10_MB_cell": "[" + ",".join(["[1, 2, 30, 40]"] * 700_000) + "]",
    "100_kB_cell": "[" + ",".join(["[1, 2, 30, 40]"] * 7_000) + "]",
    "wrong_arity": "[[1, 2, 30]]",
    "strings_not_numbers": '[["1", "2", "30", "40"]]',
    "object_not_list": '{"x0": 1}',
}


def _exam_rows(synthetic_root):
    root = synthetic_root.root
    with open(os.path.join(root, "exams.csv"), newline="") as f:
        header, *rows = list(__import__("csv").reader(f))
    for r in rows:
        r[2] = os.path.join(root, r[2])  # absolute paths inside the root: the CSV can be elsewhere
    return header, rows


def _write(path, header, rows):
    import csv

    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([header] + rows)
    return str(path)


def _assert_reported(report, csv_path, line, n_bad=1):
    assert report.num_bad == n_bad, report.to_dict()["errors"]
    e = report.errors[0]
    assert e["reason"] == "bad_row", e
    assert e["path"] == csv_path or os.path.basename(csv_path) in e["detail"], e
    assert f"line {line}" in e["detail"] and "\n" not in e["detail"], e


@pytest.mark.parametrize("case", sorted(_HOSTILE_BOXES))
def test_exam_csv_hostile_boxes_cell_reported_with_line(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_exam_csv
    from braixdet.data.report import BadInputError, BadInputReport

    header, rows = _exam_rows(synthetic_root)
    victim = next(i for i, r in enumerate(rows) if r[5] == "1" and r[6] == "full")
    bad = list(rows.pop(victim))
    bad[7] = _HOSTILE_BOXES[case]
    rows.insert(3, bad)
    csv_path = _write(tmp_path / "exams.csv", header, rows)
    report = BadInputReport("hostile")
    dicts = load_exam_csv(csv_path, synthetic_root.root, report)
    _assert_reported(report, csv_path, line=5)  # header = line 1, rows[3] = line 5
    assert len(dicts) == len(rows) - 1  # every other row still loaded
    assert bad[2] not in {d["file_name"] for d in dicts}
    with pytest.raises(BadInputError) as e:  # ON_BAD_INPUT error: one line, no other type
        load_exam_csv(csv_path, synthetic_root.root, BadInputReport("x", on_bad_input="error"))
    assert "line 5" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["nul_in_path", "100_kB_patient_id"])
def test_exam_csv_hostile_other_cells(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_exam_csv
    from braixdet.data.report import BadInputReport

    header, rows = _exam_rows(synthetic_root)
    bad = list(rows.pop(0))
    if case == "nul_in_path":
        bad[2] = bad[2].replace("1-1.dcm", "1-1\0.dcm")
    else:
        bad[0] = "p" * 100_000
    rows.append(bad)
    csv_path = _write(tmp_path / "exams.csv", header, rows)
    report = BadInputReport("hostile")
    dicts = load_exam_csv(csv_path, synthetic_root.root, report)
    _assert_reported(report, csv_path, line=len(rows) + 1)
    assert len(dicts) == len(rows) - 1


def _vindr_tree(synthetic_root, tmp_path):
    """A VinDr-Mammo layout of one synthetic patient with a malignant lesion (copies)."""
    import shutil

    truth = synthetic_root.summary["truth"]
    patient = next(t["patient"] for t in truth
                   if any(les["malignant"] for les in t["lesions"]))
    vroot = tmp_path / "vindr"
    breast, finding = [], []
    for i, t in enumerate(t for t in truth if t["patient"] == patient):
        image = f"img{i:03d}"
        (vroot / "images" / "study0").mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(synthetic_root.root, t["path"]),
                    vroot / "images" / "study0" / f"{image}.dicom")
        common = ["study0", "series", image, t["laterality"], t["view"], t["rows"], t["cols"]]
        breast.append(common + ["BI-RADS 2", "DENSITY C", "training"])
        for les in t["lesions"]:
            birads = "BI-RADS 5" if les["malignant"] else "BI-RADS 3"
            finding.append(common + ["BI-RADS 4", "DENSITY C", "['Mass']", birads, *les["bbox"],
                                     "training"])
    head = ["study_id", "series_id", "image_id", "laterality", "view_position", "height", "width"]
    bhead = head + ["breast_birads", "breast_density", "split"]
    fhead = head + ["breast_birads", "breast_density", "finding_categories", "finding_birads",
                    "xmin", "ymin", "xmax", "ymax", "split"]
    return vroot, bhead, breast, fhead, finding


_HOSTILE_NUMBERS = {
    "400_digit_number": "9" * 400,
    "json_true": "true",
    "NaN": "NaN",
    "Infinity": "Infinity",
    "1e999": "1e999",
    "underscored": "1_000",
    "fullwidth_digits": "\uff11\uff12",
}


@pytest.mark.parametrize("case", sorted(_HOSTILE_NUMBERS))
def test_vindr_hostile_box_cell_reported_with_line(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_vindr_mammo
    from braixdet.data.report import BadInputReport

    vroot, bhead, breast, fhead, finding = _vindr_tree(synthetic_root, tmp_path)
    i = next(i for i, r in enumerate(finding) if r[10] == "BI-RADS 5")
    finding[i][13] = _HOSTILE_NUMBERS[case]  # xmax of a malignant finding
    _write(vroot / "breast-level_annotations.csv", bhead, breast)
    fcsv = _write(vroot / "finding_annotations.csv", fhead, finding)
    report = BadInputReport("hostile")
    dicts = load_vindr_mammo(str(vroot), report)
    _assert_reported(report, fcsv, line=i + 2)
    assert len(dicts) == len(breast)  # the image is kept, without the box: made weak
    d = next(d for d in dicts if d["image_id"] == finding[i][2])
    assert d["annotation_type"] == "weak" and d["label"] == 1


@pytest.mark.parametrize("case", ["1e999", "400_digit_number", "NaN", "10_MB_cell"])
def test_vindr_hostile_size_cell_reported_with_line(synthetic_root, tmp_path, case):
    from braixdet.data.datasets import load_vindr_mammo
    from braixdet.data.report import BadInputReport

    vroot, bhead, breast, fhead, finding = _vindr_tree(synthetic_root, tmp_path)
    breast[1][5] = "9" * 10_000_000 if case == "10_MB_cell" else _HOSTILE_NUMBERS[case]
    bcsv = _write(vroot / "breast-level_annotations.csv", bhead, breast)
    _write(vroot / "finding_annotations.csv", fhead, finding)
    report = BadInputReport("hostile")
    dicts = load_vindr_mammo(str(vroot), report)  # 1e999 was an OverflowError
    _assert_reported(report, bcsv, line=3)
    assert len(dicts) == len(breast) - 1


@pytest.mark.parametrize("case", ["nul_in_path", "100_kB_pathology"])
def test_cbis_hostile_cells_reported_with_line(synthetic_root, tmp_path, case):
    import csv
    import shutil

    from braixdet.data.datasets import load_cbis_ddsm
    from braixdet.data.report import BadInputReport

    root = tmp_path / "cbis"
    shutil.copytree(synthetic_root.root, root)
    good = load_cbis_ddsm(str(root), BadInputReport())
    name = next(n for n in sorted(os.listdir(root)) if n.endswith("_set.csv"))
    path = str(root / name)
    with open(path, newline="") as f:
        header, *rows = list(csv.reader(f))
    col = header.index("image file path") if case == "nul_in_path" else header.index("pathology")
    rows[0][col] = rows[0][col] + "\0x" if case == "nul_in_path" else "M" * 100_000
    _write(path, header, rows)
    report = BadInputReport("hostile")
    dicts = load_cbis_ddsm(str(root), report)  # the NUL byte was a ValueError
    assert report.num_bad >= 1
    e = report.errors[0]
    assert e["reason"] == "bad_row", e
    assert f"{name}:2" in e["detail"] or (e["path"] == path and "line 2" in e["detail"]), e
    assert len(dicts) >= len(good) - 1
