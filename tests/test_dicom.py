"""DICOM reading: real pydicom-data files, VOI formulas (PS3.3 C.11.2.1.2), every error reason."""
import logging

import numpy as np
import pydicom
import pytest
from pydicom.data import get_testdata_file
from pydicom.dataelem import DataElement
from pydicom.dataset import Dataset
from pydicom.encaps import encapsulate
from pydicom.pixels import get_decoder, pixel_array
from pydicom.uid import (
    MPEG2MPML,
    JPEG2000Lossless,
    JPEGLossless,
    JPEGLosslessSV1,
    JPEGLSLossless,
    JPEGLSNearLossless,
    RLELossless,
)

from braixdet.data import dicom
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
    ({"ImageLaterality": "R", "Laterality": "L", "ViewPosition": "CC"}, None, "CC"),  # conflict
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


def _encapsulated(tmp_path, name, syntax, frame):
    ds = pydicom.dcmread(_write(tmp_path))
    ds.file_meta.TransferSyntaxUID = syntax
    ds.PixelData = encapsulate([frame])
    ds["PixelData"].VR = "OB"
    ds.save_as(tmp_path / name, enforce_file_format=True)
    return tmp_path / name


def test_reason_undecodable_names_syntax(tmp_path):
    # a JPEG Lossless decoder is installed, but this codestream is garbage
    p = _encapsulated(tmp_path, "jl.dcm", JPEGLosslessSV1, b"\xff\xd8" + b"\x00" * 64 + b"\xff\xd9")
    err = _reason(p)
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


# ------------------------------------------------------------------ lossless codecs (issue #14)
# Real files from pydicom / pydicom-data. Our reader takes MG/CR/DX; these are MR/NM/US/
# OT images, so the modality gate is widened for them: the decoding path is the same.
# The no-twin files are checked against pydicom's own reference values (pixels_reference.py).
@pytest.fixture
def any_modality(monkeypatch):
    monkeypatch.setattr(dicom, "ALLOWED_MODALITIES", ("MG", "CR", "DX", "MR", "NM", "US", "OT"))


def _testfile(name):
    path = get_testdata_file(name, download=False)  # never the network
    assert path, f"{name} is not in pydicom / pydicom-data"
    return path


def _stored(path):
    """Decoded stored values through the reader's own decoding layer."""
    ds = pydicom.dcmread(path)
    meta = dicom._meta_from_ds(path, ds, allow_for_processing=False)
    return dicom._decode_stored(path, ds, meta)


@pytest.mark.parametrize("name, syntax", [
    ("MR_small_RLE.dcm", RLELossless),
    ("MR_small_jpeg_ls_lossless.dcm", JPEGLSLossless),
    ("MR_small_jp2klossless.dcm", JPEG2000Lossless),
])
def test_real_lossless_equals_uncompressed_twin(any_modality, name, syntax):
    a, _ = read_dicom_image(_testfile("MR_small.dcm"))
    b, mb = read_dicom_image(_testfile(name))
    assert mb.transfer_syntax == syntax and a.shape == (64, 64)
    assert np.array_equal(a, b) and a.std() > 0.05
    assert np.array_equal(_stored(_testfile(name)), _stored(_testfile("MR_small.dcm")))


@pytest.mark.parametrize("name, syntax, dtype, checks", [
    # JPEG Lossless, Process 14 Selection Value 1 (.70)
    ("JPEG-LL.dcm", JPEGLosslessSV1, np.int16,
     [((400, slice(124, 132)), [60, 58, 61, 68, 59, 65, 64, 67]),
      ((600, slice(124, 132)), [3, 1, 2, 0, 2, 1, 2, 0])]),
    ("JPGLosslessP14SV1_1s_1f_8b.dcm", JPEGLosslessSV1, np.uint8,
     [((300, slice(512, 520)), [26, 26, 25, 22, 19, 16, 14, 15]),
      ((600, slice(512, 520)), [45, 43, 41, 38, 33, 30, 26, 21])]),
    # JPEG-LS lossless (.80) and near-lossless (.81)
    ("MR_small_jpeg_ls_lossless.dcm", JPEGLSLossless, np.int16,
     [((0, slice(31, 34)), [422, 319, 361]), ((-1, slice(-3, None)), [1369, 1129, 862])]),
    ("JPEGLSNearLossless_08.dcm", JPEGLSNearLossless, np.uint8,
     [((slice(0, 45, 5), 0), [255, 125, 65, 30, 15, 5, 5, 0, 0])]),
    ("JPEGLSNearLossless_16.dcm", JPEGLSNearLossless, np.uint16,
     [((slice(0, 45, 5), 0), [65535, 32765, 16385, 4095, 1025, 255, 65, 15, 5])]),
])
def test_real_jpeg_lossless_and_jpeg_ls_decode(any_modality, name, syntax, dtype, checks):
    path = _testfile(name)
    img, meta = read_dicom_image(path)
    assert meta.transfer_syntax == syntax and img.dtype == np.float32
    assert img.shape == (meta.rows, meta.cols) and 0 <= img.min() and img.max() <= 1
    stored = _stored(path)
    assert stored.dtype == dtype
    for index, values in checks:
        assert stored[index].tolist() == values


def test_real_jpeg_lossless_process14_any_selection_value(any_modality, tmp_path):
    """1.2.840.10008.1.2.4.57 (Process 14, any predictor): the corpus has no such file, but an
    SV1 codestream is a valid Process 14 one, so the same file relabelled must decode the same."""
    src = _testfile("JPGLosslessP14SV1_1s_1f_8b.dcm")
    ds = pydicom.dcmread(src)
    ds.file_meta.TransferSyntaxUID = JPEGLossless
    ds.save_as(tmp_path / "p14.dcm", enforce_file_format=True)
    a, _ = read_dicom_image(src)
    b, mb = read_dicom_image(tmp_path / "p14.dcm")
    assert mb.transfer_syntax == "1.2.840.10008.1.2.4.57" and np.array_equal(a, b)


def test_rle_of_a_mammogram_equals_native(tmp_path):
    rng = np.random.default_rng(0)
    px = (rng.integers(0, 4096, (96, 80)) * (rng.random((96, 80)) < 0.7)).astype(np.uint16)
    kw = dict(pixels=px, Modality="MG", PhotometricInterpretation="MONOCHROME1")
    a, _ = read_dicom_image(_write(tmp_path, "native.dcm", **kw))
    b, mb = read_dicom_image(_write(tmp_path, "rle.dcm", transfer_syntax=RLELossless, **kw))
    assert mb.transfer_syntax == RLELossless and np.array_equal(a, b)


@pytest.mark.parametrize("compressed, native", [
    ("emri_small_RLE.dcm", "emri_small.dcm"),  # 10 frames
    ("emri_small_jpeg_ls_lossless.dcm", "emri_small.dcm"),
    ("SC_rgb_rle.dcm", "SC_rgb.dcm"),  # RGB
    ("SC_rgb_rle_16bit.dcm", "SC_rgb_16bit.dcm"),
    ("OBXXXX1A_rle.dcm", "OBXXXX1A.dcm"),  # PALETTE COLOR
])
def test_real_lossless_twins_the_reader_refuses_still_decode(any_modality, compressed, native):
    """Multi-frame and colour files are refused by design (``unsupported``), never as
    ``undecodable``; the installed plugins decode them to their uncompressed twin's values."""
    path = _testfile(compressed)
    assert _reason(path).reason == "unsupported"
    assert np.array_equal(pixel_array(path, raw=True), pixel_array(_testfile(native), raw=True))


@pytest.mark.parametrize("syntax", [JPEGLossless, JPEGLosslessSV1, JPEGLSLossless,
                                    JPEGLSNearLossless, RLELossless])
def test_lossless_syntaxes_have_a_decoder(syntax):
    assert get_decoder(syntax).is_available, get_decoder(syntax).missing_dependencies


def test_reason_undecodable_when_no_decoder_is_installed(any_modality, tmp_path, monkeypatch):
    # a syntax nothing decodes (video) ...
    p = _encapsulated(tmp_path, "v.dcm", MPEG2MPML, b"\x00\x00\x01\xb3" + b"\x00" * 60)
    err = _reason(p)
    assert err.reason == "undecodable" and "MPEG2" in err.detail and MPEG2MPML in err.detail

    # ... and JPEG Lossless on an install without its plugin: the error names the syntax, the
    # file and what to install
    class _NoPlugin:
        is_available = False
        missing_dependencies = ["pylibjpeg - requires pylibjpeg>=2.0 and pylibjpeg-libjpeg>=2.1"]

    monkeypatch.setattr(dicom, "get_decoder", lambda uid: _NoPlugin())
    err = _reason(_testfile("JPEG-LL.dcm"))
    assert err.reason == "undecodable" and "Process 14" in err.detail
    assert JPEGLosslessSV1 in err.detail and "pylibjpeg-libjpeg" in err.detail


@pytest.mark.parametrize("name, syntax", [("JPGLosslessP14SV1_1s_1f_8b.dcm", JPEGLosslessSV1),
                                          ("MR_small_jpeg_ls_lossless.dcm", JPEGLSLossless)])
def test_reason_jpeg_frame_header_disagrees_with_rows(any_modality, tmp_path, name, syntax):
    """The codec allocates by the JPEG frame header (SOF): a crafted one that disagrees with
    Rows/Columns is refused before decoding (it could ask for gigabytes)."""
    data = bytearray(open(_testfile(name), "rb").read())
    sof = data.find(b"\xff\xc3" if syntax == JPEGLosslessSV1 else b"\xff\xf7")
    assert sof > 0
    data[sof + 5:sof + 7] = (60000).to_bytes(2, "big")  # number of lines
    (tmp_path / "sof.dcm").write_bytes(bytes(data))
    err = _reason(tmp_path / "sof.dcm")
    assert err.reason == "bad_dimensions" and "60000" in err.detail
