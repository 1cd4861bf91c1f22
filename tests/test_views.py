"""View/side resolver order, refused views, exam grouping rule and the views-CSV override."""
import shutil
import warnings

import numpy as np
import pytest
from pydicom.dataset import Dataset

from braixdet.data.dicom import DicomMeta, pseudonymise, read_dicom_meta, write_dicom
from braixdet.data.report import BadInputError, BadInputReport
from braixdet.data.views import load_views_csv, patient_stem, resolve_view
from braixdet.inference.predictor import group_exams, pair_exam, read_metas

PIXELS = np.arange(256, dtype=np.uint16).reshape(16, 16)


def _ds(**attrs):
    ds = Dataset()
    for k, v in attrs.items():
        setattr(ds, k, v)
    return ds


def _code(value, meaning, modifiers=()):
    it = _ds(CodeValue=value, CodingSchemeDesignator="SCT", CodeMeaning=meaning)
    if modifiers:
        it.ViewModifierCodeSequence = [_ds(CodeValue=v, CodingSchemeDesignator="SCT",
                                           CodeMeaning=m) for v, m in modifiers]
    return it


@pytest.mark.parametrize("attrs,view,lat,view_source,lat_source", [
    # ViewPosition first, even when later tags disagree
    (dict(ViewPosition="CC", PatientOrientation="MLO", ImageLaterality="R",
          PatientID="Mass-Test_P_00001_LEFT_MLO"), "CC", "R", "ViewPosition", "ImageLaterality"),
    # variants map explicitly
    (dict(ViewPosition="XCCL", Laterality="L"), "CC", "L", "ViewPosition", "Laterality"),
    (dict(ViewPosition="LM", Laterality="R"), "MLO", "R", "ViewPosition", "Laterality"),
    # ViewCodeSequence (CID 4014) when ViewPosition is absent or says no view name
    (dict(ViewCodeSequence=[_code("399099002", "latero-medial oblique")], ImageLaterality="L"),
     "MLO", "L", "ViewCodeSequence", "ImageLaterality"),
    (dict(ViewPosition="", ViewCodeSequence=[_code("399101009", "cranio-caudal exaggerated "
                                                   "medially")], ImageLaterality="L"),
     "CC", "L", "ViewCodeSequence", "ImageLaterality"),
    # accepted modifier: an implant-displaced CC is still a CC
    (dict(ViewCodeSequence=[_code("399162004", "cranio-caudal",
                                  [("399209000", "Implant Displaced")])], ImageLaterality="R"),
     "CC", "R", "ViewCodeSequence", "ImageLaterality"),
    # ImageLaterality before Laterality (they must agree: test_coded_tags_that_disagree_...)
    (dict(ViewPosition="MLO", ImageLaterality="L", Laterality="L"), "MLO", "L", "ViewPosition",
     "ImageLaterality"),
    # CBIS-DDSM: view in PatientOrientation, side in Laterality
    (dict(PatientOrientation="MLO", Laterality="R", PatientID="Mass-Test_P_00820_RIGHT_MLO"),
     "MLO", "R", "PatientOrientation", "Laterality"),
    # a real patient orientation is no view name: the descriptions and the naming come next
    (dict(PatientOrientation=["A", "R"], SeriesDescription="R MLO"), "MLO", "R",
     "SeriesDescription", "SeriesDescription"),
    (dict(SeriesDescription="screening", ProtocolName="LCC tomo-free"), "CC", "L",
     "ProtocolName", "ProtocolName"),
    (dict(PatientID="Calc-Training_P_00001_RIGHT_MLO"), "MLO", "R", "PatientID", "PatientID"),
    (dict(PatientID="Mass-Test_P_00173_LEFT_CC_1", Laterality="R"), "CC", "R", "PatientID",
     "Laterality"),
])
def test_resolver_order(attrs, view, lat, view_source, lat_source):
    r = resolve_view(_ds(**attrs))
    assert (r.view, r.laterality, r.refused) == (view, lat, "")
    assert (r.view_source, r.laterality_source) == (view_source, lat_source)


@pytest.mark.parametrize("attrs,why", [
    (dict(ViewCodeSequence=[_code("399162004", "cranio-caudal",
                                  [("399055006", "Spot Compression")])]), "spot compression"),
    (dict(ViewCodeSequence=[_code("399368009", "medio-lateral oblique",
                                  [("399163009", "Magnification")])]), "magnification"),
    (dict(ViewCodeSequence=[_code("R-10242", "cranio-caudal",
                                  [("X-9", "spot compression (local code)")])]), "spot"),
    (dict(ViewPosition="FB", PatientOrientation="CC"), "caudo-cranial"),
    (dict(ViewPosition="SPOT"), "spot compression"),
    (dict(ViewCodeSequence=[_code("127457009", "tissue specimen from breast")]), "specimen"),
    (dict(PatientOrientation="", SeriesDescription="ROI mask images",
          PatientID="Mass-Training_P_00001_LEFT_CC_1"), "ROI mask"),
])
def test_spot_magnification_and_other_views_refused(attrs, why):
    r = resolve_view(_ds(**attrs))
    assert r.view is None and why in r.refused and r.note().startswith("refused: ")


def test_unknown_view_note_lists_tags_without_values():
    r = resolve_view(_ds(PatientID="SECRET-4711", SeriesDescription="Jane Doe film",
                         PatientOrientation=["P", "L"], ImageLaterality="L"))
    assert (r.view, r.laterality) == (None, "L")
    note = r.note()
    for tag in ("ViewPosition", "ViewCodeSequence", "PatientOrientation", "SeriesDescription",
                "ProtocolName", "PatientID"):
        assert tag in note
    assert "SECRET" not in note and "Jane" not in note and "\n" not in note


def test_patient_stem():
    assert patient_stem("Mass-Test_P_00173_LEFT_CC") == "P_00173"
    assert patient_stem("calc-training_p_00001_right_mlo_2") == "P_00001"
    assert patient_stem(" 12345 ") == "12345" and patient_stem(None) == ""


# ------------------------------------------------------------------ files: reader + report
def _dcm(tmp_path, name, **attrs):
    attrs.setdefault("ViewPosition", None)
    attrs.setdefault("ImageLaterality", None)
    return write_dicom(tmp_path / name, PIXELS, **attrs)


def test_unknown_and_refused_views_are_one_report_line(tmp_path):
    unknown = _dcm(tmp_path, "u.dcm", PatientID="SECRET-1", Laterality="L")
    spot = _dcm(tmp_path, "s.dcm", PatientID="SECRET-2", ImageLaterality="L",
                ViewCodeSequence=[_code("399162004", "cranio-caudal",
                                        [("399055006", "Spot Compression")])])
    report = BadInputReport("t")
    assert group_exams(read_metas([unknown, spot], report), report) == []
    assert report.counts == {"unknown_view": 1, "refused_view": 1}
    lines = {e["path"]: f"{e['reason']} ({e['detail']})" for e in report.errors}
    assert "tried ViewPosition (absent), ViewCodeSequence (absent)" in lines[unknown]
    assert "PatientID (no CBIS-DDSM naming)" in lines[unknown]
    assert lines[spot] == "refused_view (refused: ViewModifierCodeSequence spot compression)"
    assert "SECRET" not in str(report.to_dict())


def test_cbis_naming_groups_and_pairs_without_shared_uid(tmp_path):
    """CBIS-DDSM as shipped, in tiny files: own StudyInstanceUID per image, view only in
    PatientOrientation, side only in Laterality; Mass-* and Calc-* names of one patient."""
    files = [_dcm(tmp_path, f"{i}.dcm", PatientID=pid, PatientOrientation=pid.split("_")[-1],
                  Laterality=pid.split("_")[-2][0], StudyDate="20161004")
             for i, pid in enumerate(["Mass-Test_P_00007_LEFT_CC", "Calc-Test_P_00007_LEFT_MLO",
                                      "Mass-Test_P_00008_LEFT_CC", "Mass-Test_P_00008_LEFT_MLO"])]
    report = BadInputReport("t")
    exams = group_exams(read_metas(files, report), report)
    assert report.num_bad == 0 and len(exams) == 2
    assert [[m.path for m in e.images] for e in exams] == [files[:2], files[2:]]
    assert exams[0].images[0].patient_id == pseudonymise("P_00007")
    for e in exams:
        assert [(p.main.view, p.aux.view) for p in pair_exam(e.images, report)] == [
            ("CC", "MLO"), ("MLO", "CC")]


# ------------------------------------------------------------------ the exam rule, exact cases
def _meta(path, uid="", patient="", hint="", lat="L", view="CC"):
    return DicomMeta(path=path, laterality=lat, view=view, study_uid=uid, series_uid="s",
                     sop_uid=path, patient_id=patient and pseudonymise(patient), modality="MG",
                     rows=16, cols=16, photometric="MONOCHROME2", presentation_intent="",
                     exam_hint=hint and pseudonymise("date:" + hint))


def _groups(metas):
    report = BadInputReport("t")
    exams = group_exams(metas, report)
    return [[m.path for m in e.images] for e in exams], exams, report


def test_exam_rule_shared_uid():
    paths, exams, _ = _groups([_meta("a", "1.2.3", "P1", "20200101"),
                               _meta("b", "1.2.3", "P1", "20210101", view="MLO"),
                               _meta("c", "1.2.4", "P1", "20200101", lat="R")])
    # a and b share their UID: one study even with different dates; c (its own UID, no
    # partner of that UID) goes by (patient, date), a group of its own here
    assert paths == [["c"], ["a", "b"]]
    assert [e.study_uid for e in exams] == ["", "1.2.3"]


def test_exam_rule_all_uids_differ_same_patient_same_date():
    paths, exams, _ = _groups([_meta(p, "1." + p, "P1", "20200101", lat=lat, view=v)
                               for p, lat, v in (("a", "L", "CC"), ("b", "L", "MLO"),
                                                 ("c", "R", "CC"), ("d", "R", "MLO"))])
    assert paths == [["a", "b", "c", "d"]] and exams[0].study_uid == ""


def test_exam_rule_different_dates_are_different_exams():
    paths, _, _ = _groups([_meta("a", "1.1", "P1", "20200101"),
                           _meta("b", "1.2", "P1", "20210101", view="MLO")])
    assert paths == [["a"], ["b"]]


def test_exam_rule_same_uid_two_patients_never_one_exam():
    paths, _, _ = _groups([_meta("a", "1.1", "P1"), _meta("b", "1.1", "P2", view="MLO")])
    assert paths == [["a"], ["b"]]


def test_exam_rule_no_identifiers_exam_of_its_own():
    paths, exams, report = _groups([_meta("a"), _meta("b", view="MLO")])
    assert paths == [["a"], ["b"]] and report.counts["no_study_uid"] == 2
    assert len({e.key for e in exams}) == 2


def test_exam_keys_are_pseudonyms():
    _, exams, _ = _groups([_meta("a", "1.2.840.99", "P_00173", "20200101")])
    key = exams[0].key
    assert len(key) == 16 and int(key, 16) >= 0
    assert "1.2.840" not in key and "00173" not in key
    assert _groups([_meta("a", "1.2.840.99", "P_00173", "20200101")])[1][0].key == key


# ------------------------------------------------------------------ views CSV
def _csv(tmp_path, text, name="views.csv"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_views_csv_overrides_tags_and_groups(tmp_path):
    sub = tmp_path / "in"
    sub.mkdir()
    a = _dcm(sub, "a.dcm", PatientID=None)  # no view, no side, no patient, own UID
    b = _dcm(sub, "b.dcm", PatientID=None, ViewPosition="CC", ImageLaterality="L")
    c = _dcm(sub, "c.dcm", PatientID=None, ViewPosition="MLO", ImageLaterality="R")
    table = load_views_csv(_csv(tmp_path, "file,laterality,view,exam\n"
                                          "a.dcm,L,MLO,exam-1\n"  # basename
                                          "in/b.dcm,,,exam-1\n"  # relative to the CSV
                                          f"{c},LEFT,,\n"))  # absolute; side only
    report = BadInputReport("t")
    metas = read_metas([a, b, c], report, overrides=table)
    assert report.counts["views_csv_override"] == 3
    assert [(m.laterality, m.view) for m in metas] == [("L", "MLO"), ("L", "CC"), ("L", "MLO")]
    paths, _, _ = _groups(metas)
    assert paths == [[b, a], [c]]  # a + b by the CSV exam; c its own UID
    assert report.num_bad == 0


@pytest.mark.parametrize("row,why", [
    ("x.dcm,X,CC,", "laterality must be"),
    ("x.dcm,L,SPOT,", "view must be"),
    ("x.dcm,L,CC", "3 cells"),
    ("x.dcm,,,", "nothing to override"),
    (",L,CC,e", "file cell"),
])
def test_views_csv_bad_rows(tmp_path, row, why):
    path = _csv(tmp_path, f"file,laterality,view,exam\ny.dcm,R,MLO,e\n{row}\n")
    report = BadInputReport("t")
    table = load_views_csv(path, report)
    assert len(table) == 1 and report.counts == {"bad_row": 1}
    assert report.errors[0]["detail"].startswith("line 3: ") and why in report.errors[0]["detail"]
    with pytest.raises(BadInputError) as ei:
        load_views_csv(path)
    assert "\n" not in str(ei.value) and path in str(ei.value)


def test_views_csv_duplicate_and_header(tmp_path):
    report = BadInputReport("t")
    load_views_csv(_csv(tmp_path, "file,laterality,view,exam\na.dcm,L,CC,\na.dcm,R,CC,\n"),
                   report)
    assert "the same file listed twice" in report.errors[0]["detail"]
    with pytest.raises(BadInputError, match="header must be file,laterality,view,exam"):
        load_views_csv(_csv(tmp_path, "path,side\n", "h.csv"))


def test_malformed_view_tags_are_absent_not_fatal():
    ds = _ds(ViewCodeSequence=[_ds(CodeValue="399162004")], Laterality="L")
    ds.ViewCodeSequence[0].ViewModifierCodeSequence = [Dataset()]  # modifier without a code
    assert (resolve_view(ds).view, resolve_view(ds).laterality) == ("CC", "L")
    # a fuzzed header: ViewCodeSequence holding bytes (the resolver takes any .get mapping)
    r = resolve_view({"ViewCodeSequence": b"\x01\x02", "PatientOrientation": "CC",
                      "Laterality": "R"})
    assert (r.view, r.laterality) == ("CC", "R") and "ViewCodeSequence (malformed)" in r.tried


# ------------------------------------------------------------------ issue 29: conflict rules
@pytest.mark.parametrize("attrs,problem,view,lat", [
    # ViewPosition CC, ViewCodeSequence MLO: neither wins
    (dict(ViewPosition="CC", ViewCodeSequence=[_code("399368009", "medio-lateral oblique")],
          ImageLaterality="L"), "view_conflict", None, "L"),
    # ImageLaterality L, Laterality R: neither wins
    (dict(ViewPosition="MLO", ImageLaterality="L", Laterality="R"), "laterality_conflict",
     "MLO", None),
])
def test_coded_tags_that_disagree_are_refused(attrs, problem, view, lat):
    r = resolve_view(_ds(**attrs))
    assert (r.problem, r.view, r.laterality) == (problem, view, lat)
    assert r.note().startswith("refused: ") and "disagree" in r.note()


@pytest.mark.parametrize("attrs,why", [
    # the modifier refuses even when ViewPosition names a screening view
    (dict(ViewPosition="CC", ImageLaterality="L", ViewCodeSequence=[_code(
        "399162004", "cranio-caudal", [("399055006", "Spot Compression")])]), "spot compression"),
    (dict(ViewPosition="MLO", ImageLaterality="R", ViewCodeSequence=[_code(
        "399368009", "medio-lateral oblique", [("399163009", "Magnification")])]),
     "magnification"),
    (dict(ViewPosition="CC", ImageLaterality="L", SeriesDescription="L CC SPOT"), "spot"),
])
def test_spot_and_magnification_refused_when_view_position_names_the_view(attrs, why):
    r = resolve_view(_ds(**attrs))
    assert r.problem == "refused_view" and r.view is None and why in r.refused


def test_conflicting_files_are_one_report_line_each(tmp_path):
    view = _dcm(tmp_path, "v.dcm", PatientID="SECRET-1", ViewPosition="CC", ImageLaterality="L",
                ViewCodeSequence=[_code("399368009", "medio-lateral oblique")])
    side = _dcm(tmp_path, "s.dcm", PatientID="SECRET-1", ViewPosition="CC", ImageLaterality="L",
                Laterality="R")
    report = BadInputReport("t")
    assert group_exams(read_metas([view, side], report), report) == []
    assert {(e["path"], e["reason"]) for e in report.errors} == {
        (view, "view_conflict"), (side, "laterality_conflict")}
    assert "SECRET" not in str(report.to_dict())


def _cbis_exam(folder, patient, date="20161004", **attrs):
    """CBIS-DDSM-like exam: 4 files, each its own StudyInstanceUID, no AccessionNumber."""
    folder.mkdir(exist_ok=True)
    return [_dcm(folder, f"{lat}{view}.dcm", PatientID=patient, StudyDate=date,
                 ViewPosition=view, ImageLaterality=lat, **attrs)
            for lat in "LR" for view in ("CC", "MLO")]


def test_views_csv_exam_never_joins_two_patients(tmp_path):
    """Issue 29 item 1: rows giving one exam value to two patients' images: one exam per
    patient, one csv_exam_split line; before, one exam of 8 images mixed both."""
    a = _cbis_exam(tmp_path / "a", "SECRET-A")
    b = _cbis_exam(tmp_path / "b", "SECRET-B")
    table = load_views_csv(_csv(tmp_path, "file,laterality,view,exam\n" + "".join(
        f"{f},,,visit-1\n" for f in a + b)))
    report = BadInputReport("t")
    exams = group_exams(read_metas(a + b, report, overrides=table), report)
    assert sorted(sorted(m.path for m in e.images) for e in exams) == [sorted(a), sorted(b)]
    assert {len({m.patient_id for m in e.images}) for e in exams} == {1}
    assert report.counts["csv_exam_split"] == 1 and report.num_bad == 0
    assert "SECRET" not in str(report.to_dict())


def test_same_day_prior_without_accession_is_not_merged(tmp_path):
    """Issue 29 item 3: a second study of one patient and day, no AccessionNumber, every image
    its own StudyInstanceUID: not merged into the current exam (each study its own exam, one
    ambiguous_exam line) -- before, one exam of 8 paired current with prior views."""
    current = _cbis_exam(tmp_path / "now", "P1")
    prior = _cbis_exam(tmp_path / "prior", "P1")
    report = BadInputReport("t")
    exams = group_exams(read_metas(current + prior, report), report)
    assert len(exams) == 8 and all(len(e.images) == 1 for e in exams)
    assert report.counts["ambiguous_exam"] == 1 and report.num_bad == 0
    assert report.errors[0]["kept"] and "studies of one patient and day" in \
        report.errors[0]["detail"]


def test_retake_and_exact_duplicate_keep_their_exam_with_a_line(tmp_path):
    """Issue 29 item 3: a retake (second L CC in a study) is one repeat_view line and the MLO's
    partner is the first CC by SOPInstanceUID; an exact copy of a file stays in its exam (before,
    a CBIS-like exam was split in two by it) with one duplicate_file line."""
    study = "1.2.826.0.1.3680043.8.498.1"
    files = [_dcm(tmp_path, f"{i}.dcm", PatientID="P1", StudyInstanceUID=study,
                  SOPInstanceUID=f"{study}.{i}", ViewPosition=v, ImageLaterality="L")
             for i, v in ((5, "CC"), (3, "CC"), (4, "MLO"))]
    report = BadInputReport("t")
    exams = group_exams(read_metas(files, report), report)
    assert len(exams) == 1 and report.counts["repeat_view"] == 1
    line = report.errors[0]
    assert line["path"] == files[0] and "L CC acquired 2 times" in line["detail"]
    pairs = {p.main.path: p.aux.path for p in pair_exam(exams[0].images)}
    assert pairs[files[2]] == files[1]  # SOPInstanceUID ...3 < ...5

    cbis = _cbis_exam(tmp_path / "cbis", "P2")
    copy = str(tmp_path / "cbis" / "zz_copy.dcm")
    shutil.copyfile(cbis[0], copy)
    report = BadInputReport("t")
    exams = group_exams(read_metas(cbis + [copy], report), report)
    assert [sorted(m.path for m in e.images) for e in exams] == [sorted(cbis + [copy])]
    assert report.counts == {"duplicate_file": 1} and report.errors[0]["path"] == copy


def test_views_csv_not_utf8_is_refused_naming_the_byte_offset(tmp_path):
    """Issue 29 item 4: one Latin-1 byte: the whole CSV refused in one line with its offset
    (before: rows lost, or 'header must be ...')."""
    head = "file,laterality,view,exam\n" + "".join(f"f{i}.dcm,L,CC,e\n" for i in range(50))
    p = tmp_path / "views.csv"
    p.write_bytes(head.encode() + "caf\u00e9.dcm,L,CC,e\n".encode("latin-1"))
    with pytest.raises(BadInputError) as ei:
        load_views_csv(str(p), BadInputReport("t"))
    offset = len(head.encode()) + 3
    assert ei.value.reason == "bad_encoding" and f"offset {offset} (line 52)" in str(ei.value)
    assert "\n" not in str(ei.value)
    p.write_bytes(b"\xef\xbb\xbf" + "file,laterality,view,exam\nx\u00e9.dcm,L,CC,e\n".encode())
    assert len(load_views_csv(str(p))) == 1  # UTF-8 with a BOM is read


@pytest.mark.parametrize("attrs,reason,detail", [
    (dict(StudyInstanceUID="1.2.abc"), "invalid_value", "StudyInstanceUID (UI) is not valid"),
    (dict(SOPInstanceUID="1.02.3"), "invalid_value", "SOPInstanceUID (UI) is not valid"),
    (dict(StudyInstanceUID=None), "missing_uid", "no StudyInstanceUID"),
    (dict(PatientID="SECRET-" + "9" * 60), "invalid_value", "PatientID (LO) is longer"),
    (dict(PatientID="SECRET/../\x00x"), "invalid_value", "PatientID (LO) holds a control"),
    (dict(AccessionNumber="SECRET-ACC-123456"), "invalid_value", "AccessionNumber (SH) is longer"),
    (dict(PatientName="Doe^SECRET\x07"), "invalid_value", "PatientName (PN) holds a control"),
])
def test_values_invalid_for_their_vr_are_refused_at_read_time(tmp_path, attrs, reason, detail):
    """Issue 29 items 2 and 5: the predictor's reader refuses what its SR would copy wrongly,
    one line naming the attribute and VR, never the value."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydicom warns when writing the crafted value
        f = _dcm(tmp_path, "x.dcm", ViewPosition="CC", ImageLaterality="L", **attrs)
    report = BadInputReport("t")
    assert read_metas([f], report) == []
    assert report.errors == [{"path": f, "reason": reason, "detail": report.errors[0]["detail"]}]
    assert detail in report.errors[0]["detail"] and "SECRET" not in str(report.to_dict())
    assert read_dicom_meta(f).view == "CC"  # the training loaders' reader does not refuse it
