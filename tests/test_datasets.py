"""Dataset loaders (CBIS-DDSM, VinDr-Mammo layout, exam CSV), pairing and bad inputs."""
import csv
import json
import os
import shutil

import pytest

from braixdet.data.datasets import load_cbis_ddsm, load_exam_csv, load_vindr_mammo
from braixdet.data.dicom import pseudonymise
from braixdet.data.pairing import pair_views
from braixdet.data.report import BadInputError, BadInputReport


def _rel(root, path):
    return os.path.relpath(path, root).replace(os.sep, "/")


def _box_close(a, b, tol=1.0):
    return all(abs(x - y) <= tol for x, y in zip(a, b))


def _boxes(d):
    return sorted(a["bbox"] for a in d.get("annotations", []))


def _copy(synthetic_root, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(synthetic_root.root, dst)
    return str(dst)


def test_cbis_ddsm_matches_truth(synthetic_root):
    root, truth = synthetic_root.root, synthetic_root.summary["truth"]
    report = BadInputReport("cbis")
    dicts = load_cbis_ddsm(root, report)
    listed = {t["path"]: t for t in truth if t["lesions"]}  # CBIS lists abnormal images only
    assert report.num_bad == 0, report.to_dict()
    assert len(dicts) == len(listed)
    for d in dicts:
        t = listed[_rel(root, d["file_name"])]
        assert d["file_name"].endswith("1-1.dcm")  # CSV says 000000.dcm
        assert d["label"] == t["cancer_label"]
        assert d["annotation_type"] == "full"
        assert (d["laterality"], d["view"], d["split"]) == (t["laterality"], t["view"],
                                                              t["split"])
        assert (d["height"], d["width"]) == (t["rows"], t["cols"])
        assert d["patient_id"] == pseudonymise(t["patient"])  # P_xxxxx, not the per-view ID
        want = sorted(les["bbox"] for les in t["lesions"] if les["malignant"])
        got = _boxes(d)
        assert len(got) == len(want) and all(_box_close(g, w) for g, w in zip(got, want))
        assert not d["aux_missing"]  # CBIS lesions are rendered in both views
        assert _rel(root, d["aux_file_name"]) in listed
    # patient grouping: one pseudonymous patient per P_xxxxx, across views and breasts
    assert len({d["patient_id"] for d in dicts}) == len({t["patient"] for t in listed.values()})
    # the quirks were really exercised
    assert synthetic_root.summary["swapped_masks"] >= 1
    swapped = {t["path"] for t in listed.values() for les in t["lesions"] if les["mask_swapped"]
               and les["malignant"]}
    cells = []
    for name in os.listdir(root):
        if name.endswith("_set.csv"):
            with open(os.path.join(root, name), newline="") as f:
                cells += [c for row in csv.reader(f) for c in row]
    assert any(c != c.strip() for c in cells)
    # no raw identifiers anywhere but in file paths
    raw = {t["PatientID"] for t in truth} | {t["PatientName"] for t in truth}
    raw |= {t["PatientBirthDate"] for t in truth}
    for d in dicts:
        for k, v in d.items():
            if k not in ("file_name", "aux_file_name"):
                assert not any(r in str(v) for r in raw), (k, v)
    assert not any(r in json.dumps(report.to_dict()) for r in raw)
    if swapped:  # boxes of swapped-mask lesions checked above already; make it explicit
        assert all(_boxes(d) for d in dicts if _rel(root, d["file_name"]) in swapped)


def test_exam_csv_matches_truth(synthetic_root):
    root, truth = synthetic_root.root, synthetic_root.summary["truth"]
    report = BadInputReport("exam")
    dicts = load_exam_csv("exams.csv", root, report)
    assert report.num_bad == 0 and len(dicts) == len(truth)
    by_path = {t["path"]: t for t in truth}
    for d in dicts:
        t = by_path[_rel(root, d["file_name"])]
        assert d["patient_id"] == pseudonymise(t["anon_patient"])
        assert d["label"] == t["cancer_label"]
        assert d["annotation_type"] == t["annotation"]
        if t["annotation"] == "weak":
            assert "annotations" not in d
        else:
            want = sorted(les["bbox"] for les in t["lesions"] if les["malignant"])
            assert _boxes(d) == [[float(v) for v in b] for b in want]
    assert report.counts["aux_missing"] == 0
    assert len({d["image_id"] for d in dicts}) == len(dicts)


def _write_csv(path, header, rows):
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)


def test_vindr_layout(synthetic_root, tmp_path):
    """A tiny VinDr-Mammo tree made of copies of the synthetic DICOMs (never written in place)."""
    root, truth = synthetic_root.root, synthetic_root.summary["truth"]
    patients = sorted({t["patient"] for t in truth})[:3]
    vroot = tmp_path / "vindr"
    breast, finding = [], []
    for i, t in enumerate(t for t in truth if t["patient"] in patients):
        study, image = f"study{patients.index(t['patient'])}", f"img{i:03d}"
        (vroot / "images" / study).mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(root, t["path"]), vroot / "images" / study / f"{image}.dicom")
        split = "training" if t["split"] == "train" else "test"
        common = [study, "series", image, t["laterality"], t["view"], t["rows"], t["cols"]]
        breast.append(common + ["BI-RADS 2", "DENSITY C", split])
        if not t["lesions"]:
            finding.append(common + ["BI-RADS 1", "DENSITY C", "['No Finding']", "", "", "", "",
                                     "", split])
        for les in t["lesions"]:
            birads = "BI-RADS 5" if les["malignant"] else "BI-RADS 3"
            finding.append(common + ["BI-RADS 4", "DENSITY C", "['Mass']", birads, *les["bbox"],
                                     split])
    head = ["study_id", "series_id", "image_id", "laterality", "view_position", "height", "width"]
    _write_csv(vroot / "breast-level_annotations.csv",
               head + ["breast_birads", "breast_density", "split"], breast)
    _write_csv(vroot / "finding_annotations.csv",
               head + ["breast_birads", "breast_density", "finding_categories", "finding_birads",
                       "xmin", "ymin", "xmax", "ymax", "split"], finding)
    report = BadInputReport("vindr")
    dicts = load_vindr_mammo(str(vroot), report)
    assert report.num_bad == 0 and len(dicts) == len(breast) == 12
    assert len({d["patient_id"] for d in dicts}) == 3 and report.counts["aux_missing"] == 0
    sel = [t for t in truth if t["patient"] in patients]
    for d, t in zip(sorted(dicts, key=lambda d: d["image_id"]), sel):
        assert d["label"] == t["cancer_label"] and d["split"] == t["split"]
        want = sorted(les["bbox"] for les in t["lesions"] if les["malignant"])
        assert _boxes(d) == [[float(v) for v in b] for b in want]
    # BI-RADS 3 counted malignant when configured
    dicts3 = load_vindr_mammo(str(vroot), BadInputReport(), malignant_birads=(3, 4, 5))
    assert sum(d["label"] for d in dicts3) == sum(bool(t["lesions"]) for t in sel)


def test_pairing_rules():
    def d(i, view, lat="L", exam="e"):
        return {"image_id": i, "file_name": f"/x/{i}.dcm", "patient_id": "p", "exam_id": exam,
                "laterality": lat, "view": view}

    ds = [d("a", "CC"), d("b", "ML"), d("c", "MLO"), d("e", "CC", "R"), d("f", "MLO", exam="e2")]
    report = BadInputReport()
    pair_views(ds, report)
    assert ds[0]["aux_image_id"] == "b"  # ML counts as MLO; first candidate by image_id
    assert ds[1]["aux_image_id"] == ds[2]["aux_image_id"] == "a"
    assert ds[3]["aux_missing"] and ds[3]["aux_file_name"] == ds[3]["file_name"]
    assert ds[4]["aux_missing"]  # other exam
    assert report.counts["aux_missing"] == 2


def test_deleted_view_counts_aux_missing(synthetic_root, tmp_path):
    root = _copy(synthetic_root, tmp_path)
    t = next(t for t in synthetic_root.summary["truth"] if t["view"] == "CC")
    os.remove(os.path.join(root, t["path"]))
    report = BadInputReport()
    dicts = load_exam_csv("exams.csv", root, report)
    assert report.counts["missing_file"] == 1 and report.counts["aux_missing"] == 1
    partner = [d for d in dicts if d["aux_missing"]]
    assert len(partner) == 1 and partner[0]["view"] == "MLO"
    assert partner[0]["aux_file_name"] == partner[0]["file_name"]


def test_bad_inputs_exam_csv(synthetic_root, tmp_path):
    root = _copy(synthetic_root, tmp_path)
    truth = synthetic_root.summary["truth"]
    with open(os.path.join(root, "not_a_dicom.dcm"), "w") as f:
        f.write("hello, I am text\n")
    good = next(t for t in truth if t["cancer_label"] == 1 and t["annotation"] == "full")
    with open(os.path.join(root, "exams.csv"), newline="") as f:
        rows = list(csv.reader(f))
    # drop the good image's own row: it comes back with edited boxes
    rows = [r for r in rows if r[2] != good["path"]]
    extra = [
        ["p9", "e9", "CBIS-DDSM/missing/1-1.dcm", "L", "CC", "0", "full", "[]", "train"],
        ["p9", "e9", "not_a_dicom.dcm", "L", "MLO", "0", "full", "[]", "train"],
        ["p9", "e9", "../../etc/passwd", "R", "CC", "0", "full", "[]", "train"],
        ["p9", "e9", good["path"], good["laterality"], good["view"], "1", "full",
         json.dumps([[1000, 1000, 1100, 1100], [-5, -5, 10, 10], [3, 3, 3, 9]]), "train"],
        ["p9", "e9", "x.dcm", "L", "CC", "maybe", "full", "[]", "train"],
        ["p9", "e9", "x.dcm", "L", "CC"],
    ]
    with open(os.path.join(root, "exams.csv"), "w", newline="") as f:
        csv.writer(f).writerows(rows + extra)
    report = BadInputReport("bad")
    dicts = load_exam_csv("exams.csv", root, report)
    c = report.counts
    assert c["missing_file"] == 1 and c["not_dicom"] == 1 and c["path_escapes_root"] == 1
    assert c["box_outside_image"] == 2 and c["box_clipped"] == 1 and c["bad_row"] == 2
    assert len(dicts) == len(truth)  # the good image kept with its one clipped box
    d = next(d for d in dicts if _rel(root, d["file_name"]) == good["path"])
    assert _boxes(d) == [[0.0, 0.0, 10.0, 10.0]]
    assert all("\n" not in e["path"] + e["detail"] for e in report.errors)  # one line each
    report.save(str(tmp_path / "r.json"))
    assert json.load(open(tmp_path / "r.json"))["counts"]["bad_row"] == 2
    with pytest.raises(BadInputError):
        load_exam_csv("exams.csv", root, BadInputReport("bad", on_bad_input="error"))


def test_bad_inputs_cbis(synthetic_root, tmp_path):
    root = _copy(synthetic_root, tmp_path)
    path = os.path.join(root, "mass_case_description_train_set.csv")
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    rows[1][11] = "../../etc/passwd"  # image file path
    rows[2] = rows[2][:5]  # truncated row
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    report = BadInputReport()
    load_cbis_ddsm(root, report)
    assert report.counts["path_escapes_root"] == 1 and report.counts["bad_row"] == 1
    with pytest.raises(BadInputError):
        load_cbis_ddsm(root, BadInputReport(on_bad_input="error"))


def test_cbis_mask_size_mismatch_rescaled(synthetic_root, tmp_path):
    import cv2
    import numpy as np
    import pydicom

    root = _copy(synthetic_root, tmp_path)
    t = next(t for t in synthetic_root.summary["truth"]
             if any(les["malignant"] for les in t["lesions"]))
    les = next(les for les in t["lesions"] if les["malignant"])
    ds = pydicom.dcmread(os.path.join(root, les["mask_path"]))
    big = cv2.resize(ds.pixel_array, None, fx=2, fy=2, interpolation=cv2.INTER_NEAREST)
    ds.Rows, ds.Columns = big.shape
    ds.PixelData = np.ascontiguousarray(big).tobytes()
    ds.save_as(os.path.join(root, les["mask_path"]))
    report = BadInputReport()
    dicts = load_cbis_ddsm(root, report)
    assert report.counts["mask_rescaled"] == 1 and report.num_bad == 0
    d = next(d for d in dicts if _rel(root, d["file_name"]) == t["path"])
    assert any(_box_close(b, les["bbox"]) for b in _boxes(d))


def test_exam_csv_counts_dicom_view_and_side_disagreement(tmp_path):
    """The CSV wins; the DICOM's own view/side (the predictor's resolver) is counted when it
    says otherwise: here PatientOrientation 'MLO' and Laterality 'R' vs the CSV's L CC."""
    import numpy as np

    from braixdet.data.dicom import write_dicom

    px = np.arange(256, dtype=np.uint16).reshape(16, 16)
    write_dicom(tmp_path / "a.dcm", px, PatientOrientation="MLO", Laterality="R")
    write_dicom(tmp_path / "b.dcm", px, PatientOrientation="MLO", Laterality="L")
    with open(tmp_path / "exams.csv", "w", newline="") as f:
        csv.writer(f).writerows([
            ["patient_id", "exam_id", "image_path", "laterality", "view", "cancer_label",
             "annotation", "boxes", "split"],
            ["p1", "e1", "a.dcm", "L", "CC", "0", "full", "[]", "train"],
            ["p1", "e1", "b.dcm", "L", "MLO", "0", "full", "[]", "train"]])
    report = BadInputReport("t")
    dicts = load_exam_csv("exams.csv", str(tmp_path), report)
    assert [(d["laterality"], d["view"]) for d in dicts] == [("L", "CC"), ("L", "MLO")]
    assert report.counts["laterality_disagreement"] == 1
    assert report.counts["view_disagreement"] == 1
