"""DICOM reading: real pydicom-data files, VOI formulas (PS3.3 C.11.2.1.2), every error reason."""
import logging

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate
from pydicom.uid import JPEGLosslessSV1

from braixdet.data.dicom import pseudonymise, read_dicom_image, read_dicom_meta, write_dicom
from braixdet.data.report import BadInputError

# 12-bit ramp covering every stored value 0..4095 (64 x 64)
RAMP = np.arange(4096, dtype=np.uint16).reshape(64, 64)


def _write(tmp_path, name="a.dcm", pixels=RAMP, **kw):
    kw.setdefault("bits_stored", 12)
    return write_dicom(tmp_path / name, pixels, **kw)


def _reason(path, **kw):
    with pytest.raises(BadInputError) as ei:
        read_dicom_image(path, **kw)
    err = ei.value
    assert "\n" not in str(err) and str(path) in str(err)
    return err


# ------------------------------------------------------------------ real files (not ours)
def test_real_cr_uncompressed_equals_jpeg2000_lossless():
    a, ma = read_dicom_image(get_testdata_file("RG1_UNCR.dcm"))
    b, mb = read_dicom_image(get_testdata_file("RG1_J2KR.dcm"))
    assert a.shape == b.shape == (1955, 1841) and a.dtype == np.float32
    assert np.array_equal(a, b)
    assert 0.0 <= a.min() and a.max() <= 1.0 and a.std() > 0.05
    assert ma.modality == "CR" and ma.photometric == "MONOCHROME1"
    assert mb.transfer_syntax == "1.2.840.10008.1.2.4.90"


def test_real_monochrome1_is_inverted():
    path = get_testdata_file("RG1_UNCR.dcm")
    img, _ = read_dicom_image(path)
    ds = pydicom.dcmread(path)
    raw = ds.pixel_array.astype(np.float64)
    # MONOCHROME1: low stored values are bright -> output must anti-correlate with raw values
    assert np.corrcoef(raw.ravel()[::7], img.ravel()[::7])[0, 1] < -0.95
    # window from the file (C=15000, W=30000, LINEAR): check one pixel against the formula
    c, w = float(ds.WindowCenter), float(ds.WindowWidth)
    y, x = 1000, 900
    lin = np.clip((raw[y, x] - (c - 0.5)) / (w - 1) + 0.5, 0, 1)
    assert img[y, x] == pytest.approx(1 - lin, abs=1e-6)


def test_meta_without_pixels_and_pseudonymised(tmp_path, caplog):
    p = _write(tmp_path, PatientID="SECRET-123", PatientName="Doe^Jane",
               ImageLaterality="L", ViewPosition="MLO")
    caplog.set_level(logging.DEBUG)
    m = read_dicom_meta(p)
    assert (m.laterality, m.view, m.rows, m.cols) == ("L", "MLO", 64, 64)
    assert m.patient_id == pseudonymise("SECRET-123") and len(m.patient_id) == 16
    assert m.patient_id != pseudonymise("SECRET-124")
    assert "SECRET" not in caplog.text and "Doe" not in caplog.text
    assert "SECRET" not in repr(m)


def test_error_details_never_echo_identifiers(tmp_path):
    # a malformed header can put identifier text into a value the error message quotes
    p = _write(tmp_path, PatientName="Doe^Jane", PatientID="ID-4711",
               PhotometricInterpretation="Doe^Jane ID-4711")
    err = _reason(p)
    assert err.reason == "unsupported" and "<redacted>" in err.detail
    assert "Doe^Jane" not in str(err) and "ID-4711" not in str(err)


# ------------------------------------------------------------------ VOI / windowing
def _linear(x, c, w):
    """PS3.3 C.11.2.1.2.1 (LINEAR), normalised to [0, 1]."""
    y = (x - (c - 0.5)) / (w - 1) + 0.5
    y = np.where(x <= c - 0.5 - (w - 1) / 2, 0.0, y)
    return np.where(x > c - 0.5 + (w - 1) / 2, 1.0, y)


def _linear_exact(x, c, w):
    """PS3.3 C.11.2.1.3.2 (LINEAR_EXACT)."""
    y = (x - c) / w + 0.5
    return np.where(x <= c - w / 2, 0.0, np.where(x > c + w / 2, 1.0, y))


def _sigmoid(x, c, w):
    """PS3.3 C.11.2.1.3.1 (SIGMOID)."""
    return 1.0 / (1.0 + np.exp(-4.0 * (x - c) / w))


@pytest.mark.parametrize("func,ref", [("LINEAR", _linear), ("LINEAR_EXACT", _linear_exact),
                                      ("SIGMOID", _sigmoid)])
def test_window_functions_match_standard(tmp_path, func, ref):
    c, w = 2000.0, 101.0
    slope, intercept = 2.0, -2000.0  # modality LUT first: windows are in rescaled units
    p = _write(tmp_path, WindowCenter=c, WindowWidth=w, VOILUTFunction=func,
               RescaleSlope=slope, RescaleIntercept=intercept)
    img, _ = read_dicom_image(p)
    x = RAMP.astype(np.float64) * slope + intercept
    np.testing.assert_allclose(img, ref(x, c, w), atol=1e-5)
    # the three functions really differ here, so the check above discriminates
    others = [f for f in (_linear, _linear_exact, _sigmoid) if f is not ref]
    for f in others:
        assert np.abs(img - f(x, c, w)).max() > 1e-3


def test_several_windows_first_is_used(tmp_path):
    p = _write(tmp_path, WindowCenter=[1000.0, 3000.0], WindowWidth=[500.0, 800.0])
    img, _ = read_dicom_image(p)
    x = RAMP.astype(np.float64)
    np.testing.assert_allclose(img, _linear(x, 1000.0, 500.0), atol=1e-5)
    assert np.abs(img - _linear(x, 3000.0, 800.0)).max() > 0.5


def test_voi_lut_sequence(tmp_path):
    first, n = 100, 2048
    lut = (np.sqrt(np.arange(n) / (n - 1)) * 4000 + 50).astype(np.uint16)
    item = Dataset()
    item.add(DataElement(0x00283002, "US", [n, first, 16]))  # LUTDescriptor
    item.add(DataElement(0x00283006, "US", lut.tolist()))  # LUTData
    p = _write(tmp_path, VOILUTSequence=[item])
    img, _ = read_dicom_image(p)
    idx = np.clip(RAMP.astype(np.int64) - first, 0, n - 1)
    expected = (lut[idx].astype(np.float64) - lut.min()) / (lut.max() - lut.min())
    np.testing.assert_allclose(img, expected, atol=1e-6)


def test_pixel_padding_masked(tmp_path):
    px = np.full((32, 32), 1500, np.uint16)
    px[:, :8] = 0  # padding; MONOCHROME1 would make it the brightest value
    px[10:20, 12:20] = 2500
    p = _write(tmp_path, pixels=px, photometric="MONOCHROME1", PixelPaddingValue=0,
               WindowCenter=2000.0, WindowWidth=2000.0)
    img, _ = read_dicom_image(p)
    assert np.all(img[:, :8] == 0.0)
    assert img[0, 10] > img[15, 15] > 0  # inverted: higher stored value is darker
    # without the padding attribute those pixels would be bright: the mask matters
    p2 = _write(tmp_path, "b.dcm", pixels=px, photometric="MONOCHROME1",
                WindowCenter=2000.0, WindowWidth=2000.0)
    assert read_dicom_image(p2)[0][0, 0] == 1.0


def test_no_window_uses_percentiles(tmp_path):
    rng = np.random.default_rng(0)
    px = rng.permutation(10000).astype(np.uint16).reshape(100, 100)
    img, _ = read_dicom_image(_write(tmp_path, pixels=px, bits_stored=14))
    x = px.astype(np.float64)
    p0 = np.percentile(x, 0.5, method="inverted_cdf")
    p1 = np.percentile(x, 99.5, method="inverted_cdf")
    np.testing.assert_allclose(img, np.clip((x - p0) / (p1 - p0), 0, 1), atol=1e-6)
    assert 0.004 < (img == 1.0).mean() < 0.006 and 0.004 < (img == 0.0).mean() < 0.006


# ------------------------------------------------------------------ header semantics
def test_for_processing_refused_unless_allowed(tmp_path):
    p = _write(tmp_path, PresentationIntentType="FOR PROCESSING")
    assert _reason(p).reason == "for_processing"
    with pytest.raises(BadInputError):
        read_dicom_meta(p)
    img, m = read_dicom_image(p, allow_for_processing=True)
    assert img.shape == (64, 64) and m.presentation_intent == "FOR PROCESSING"


def _code(value, meaning, scheme="SCT"):
    it = Dataset()
    it.CodeValue, it.CodingSchemeDesignator, it.CodeMeaning = value, scheme, meaning
    return it


@pytest.mark.parametrize("attrs,lat,view", [
    ({"ImageLaterality": "R", "Laterality": "L", "ViewPosition": "CC"}, "R", "CC"),
    ({"ImageLaterality": None, "Laterality": "L", "ViewPosition": "XCCL"}, "L", "CC"),
    ({"ViewPosition": "ML"}, None, "MLO"),
    ({"ViewPosition": "LMO"}, None, "MLO"),
    ({"ViewCodeSequence": [_code("399368009", "medio-lateral oblique")]}, None, "MLO"),
    ({"ViewCodeSequence": [_code("R-10242", "cranio-caudal", "SRT")]}, None, "CC"),
    ({"ViewCodeSequence": [_code("X-1", "Medio-lateral oblique", "99LOCAL")]}, None, "MLO"),
    ({"ViewCodeSequence": [_code("X-2", "cranio-caudal", "99LOCAL")]}, None, "CC"),
])
def test_laterality_and_view_fallbacks(tmp_path, attrs, lat, view):
    m = read_dicom_meta(_write(tmp_path, **attrs))
    assert (m.laterality, m.view) == (lat, view)


# ------------------------------------------------------------------ every error reason
def test_reason_missing_file(tmp_path):
    assert _reason(tmp_path / "nope.dcm").reason == "missing_file"


def test_reason_not_dicom(tmp_path):
    p = tmp_path / "x.dcm"
    p.write_text("this is a CSV, not an image\n1,2,3\n")
    assert _reason(p).reason == "not_dicom"
    (tmp_path / "empty.dcm").write_bytes(b"")
    assert _reason(tmp_path / "empty.dcm").reason == "not_dicom"


def test_reason_truncated(tmp_path):
    p = _write(tmp_path)
    data = open(p, "rb").read()
    (tmp_path / "t.dcm").write_bytes(data[:-1000])  # cut inside the pixel data
    assert _reason(tmp_path / "t.dcm").reason == "truncated"
    j = open(get_testdata_file("RG1_J2KR.dcm"), "rb").read()
    (tmp_path / "j.dcm").write_bytes(j[: len(j) // 2])  # cut inside encapsulated fragments
    assert _reason(tmp_path / "j.dcm").reason == "truncated"


def test_reason_no_pixel_data(tmp_path):
    assert _reason(_write(tmp_path, PixelData=None)).reason == "no_pixel_data"


def test_reason_undecodable_names_syntax(tmp_path):
    p = _write(tmp_path)
    ds = pydicom.dcmread(p)
    ds.file_meta.TransferSyntaxUID = JPEGLosslessSV1  # no decoder installed for it
    ds.PixelData = encapsulate([b"\xff\xd8\xff\xc3" + b"\x00" * 64 + b"\xff\xd9"])
    ds["PixelData"].VR = "OB"
    ds.save_as(tmp_path / "jl.dcm", enforce_file_format=True)
    err = _reason(tmp_path / "jl.dcm")
    assert err.reason == "undecodable" and "JPEG Lossless" in err.detail


def test_reason_wrong_modality_but_cr_dx_accepted(tmp_path):
    assert _reason(_write(tmp_path, Modality="US")).reason == "wrong_modality"
    read_dicom_image(_write(tmp_path, "dx.dcm", Modality="DX"))
    read_dicom_image(_write(tmp_path, "nomod.dcm", Modality=None))


@pytest.mark.parametrize("attrs", [{"Rows": 0}, {"Rows": 60000}, {"Columns": 128}])
def test_reason_bad_dimensions(tmp_path, attrs):
    assert _reason(_write(tmp_path, **attrs)).reason == "bad_dimensions"


def test_reason_unsupported(tmp_path):
    assert _reason(_write(tmp_path, PhotometricInterpretation="RGB")).reason == "unsupported"
    assert _reason(_write(tmp_path, "f.dcm", NumberOfFrames=2)).reason == "unsupported"
