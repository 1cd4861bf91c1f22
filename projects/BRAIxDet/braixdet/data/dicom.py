"""Robust mammogram DICOM reading (pydicom 3): meta without pixels, and pixels as float32 [0, 1].

Pipeline (docs/DESIGN.md §2.1): stored values -> Modality LUT / rescale -> VOI LUT or window
(first one) -> invert MONOCHROME1 -> PixelPaddingValue pixels -> 0 -> [0, 1]. Without any VOI, a
robust 0.5/99.5 % percentile window is used **(choice)**. Every problem with a file becomes a
``BadInputError(path, reason, detail)`` whose message is one line; nothing else escapes.

Patient identifiers never leave this module in the clear: ``DicomMeta.patient_id`` is
``pseudonymise(patient stem)`` (the PatientID, or ``P_00173`` of CBIS-DDSM's per-view
``Mass-Test_P_00173_LEFT_CC``) and no raw PatientID/PatientName/PatientBirthDate is logged.
"""
import hashlib
import io
import logging
import os
import re
import struct
import warnings
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pydicom
import pydicom.config
from pydicom.encaps import generate_fragments, parse_basic_offsets
from pydicom.errors import InvalidDicomError
from pydicom.pixels import apply_modality_lut, apply_voi_lut, get_decoder, pixel_array
from pydicom.uid import (
    UID,
    ExplicitVRLittleEndian,
    ImplicitVRLittleEndian,
    JPEG2000TransferSyntaxes,
    JPEGLSTransferSyntaxes,
    JPEGTransferSyntaxes,
    RLELossless,
)
from pydicom.valuerep import validate_value

from .report import BadInputError
from .views import patient_stem, resolve_view

logger = logging.getLogger(__name__)

__all__ = [
    "DicomMeta",
    "read_dicom_meta",
    "read_dicom_image",
    "pseudonymise",
    "write_dicom",
    "ALLOWED_MODALITIES",
]

PSEUDONYM_SALT = "braixdet-v1"
# pydicom's bundled real test files are CR/DX; full-field digital mammograms are MG.
ALLOWED_MODALITIES = ("MG", "CR", "DX")
MAX_SIDE = 20000  # rows / columns above this are absurd for a mammogram
# Decompression-bomb guard: largest grid we will decode (FFDM is ~4096x3328 = 14 Mpx).
MAX_PIXELS = 100_000_000
# Largest plausible compression ratio for a big image (lossless mammograms are ~2-5:1).
MAX_COMPRESSION_RATIO = 500
_LUT_MAX_ENTRIES = 1 << 20  # stored-value range up to which the intensity pipeline is a LUT
MIN_SIDE = 8  # smaller images carry no mammogram (our choice; FFDM is thousands of pixels)
# |RescaleSlope| range and |RescaleIntercept| limit of a sane modality LUT (our choice): outside
# it the rescaled values overflow or collapse and the canonical image is black
_SLOPE_RANGE, _INTERCEPT_MAX = (1e-6, 1e6), 1e9



@dataclass
class DicomMeta:
    path: str
    laterality: Optional[str]  # "L" | "R" | None (unknown)
    view: Optional[str]  # "CC" | "MLO" | None (other or unknown)
    study_uid: str
    series_uid: str
    sop_uid: str
    patient_id: str  # pseudonymised ("" when the file has no PatientID)
    modality: str
    rows: int
    cols: int
    photometric: str
    presentation_intent: str  # "FOR PRESENTATION" | "FOR PROCESSING" | ""
    transfer_syntax: str = ""
    # Exam grouping (inference/predictor.py group_exams): pseudonymised AccessionNumber, else
    # StudyDate ("" when neither); ``patient_id`` is the pseudonymised patient STEM.
    exam_hint: str = ""
    # Why view/laterality is None: "unknown_view" or "refused_view", with the resolver's
    # identifier-free note (the tags tried, or the refusal reason).
    view_problem: str = ""
    view_note: str = ""


def pseudonymise(raw_id) -> str:
    """Stable pseudonym of a patient id: sha256(salt + id), 16 hex chars."""
    return hashlib.sha256((PSEUDONYM_SALT + str(raw_id)).encode("utf-8")).hexdigest()[:16]


def _one_line(msg, limit=200):
    msg = "".join(c if c.isprintable() else "?" for c in str(msg))
    return re.sub(r"\s+", " ", msg).strip()[:limit]


_IDENTIFIERS = ("PatientID", "PatientName", "PatientBirthDate", "OtherPatientIDs",
                "OtherPatientNames", "AccessionNumber")


def _scrubbed(err, ds):
    """Remove identifier values a malformed header may have leaked into an error detail."""
    detail = err.detail
    if ds is not None and detail:
        for k in _IDENTIFIERS:
            try:
                v = str(ds.get(k, "") or "").strip()
            except Exception:  # noqa: BLE001 - the header is malformed anyway
                continue
            if len(v) >= 3:
                detail = detail.replace(v, "<redacted>")
        detail = re.sub(r"\b(19|20)\d{6}\b", "<date>", detail)  # anything that looks like a DOB
    if detail == err.detail:
        return err
    return BadInputError(err.path, err.reason, detail)


def _str(ds, keyword):
    v = ds.get(keyword, "")
    if v is None:
        return ""
    if isinstance(v, pydicom.multival.MultiValue):
        v = v[0] if len(v) else ""
    return str(v).strip()


def _view_from_ds(ds):
    """views.resolve_view: the one resolver of loaders and predictor (order in its doc)."""
    return resolve_view(ds)


def _exam_hint(ds):
    """Pseudonym of AccessionNumber, else of StudyDate, else "" (see group_exams)."""
    acc, date = _str(ds, "AccessionNumber"), _str(ds, "StudyDate")
    return pseudonymise("acc:" + acc) if acc else pseudonymise("date:" + date) if date else ""


def _fail(path, reason, detail=""):
    raise BadInputError(path, reason, _one_line(detail))


def _dcmread(path, stop_before_pixels):
    """dcmread with our error mapping; returns (dataset, list of warning messages)."""
    if not os.path.isfile(path):
        _fail(path, "missing_file", "no such file")
    if os.path.getsize(path) == 0:
        _fail(path, "not_dicom", "empty file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            # Big values are deferred: their declared length tells truncated pixel data apart.
            ds = pydicom.dcmread(path, stop_before_pixels=stop_before_pixels, defer_size="64 KB")
        except InvalidDicomError:
            # No preamble/DICM: accept only if a forced parse finds image attributes.
            try:
                ds = pydicom.dcmread(path, stop_before_pixels=stop_before_pixels, force=True,
                                     defer_size="64 KB")
            except Exception as e:  # noqa: BLE001 - anything unparsable is not DICOM
                _fail(path, "not_dicom", f"{type(e).__name__}: {e}")
            if not any(k in ds for k in ("SOPClassUID", "Rows", "PixelData", "Modality")):
                _fail(path, "not_dicom", "no DICOM preamble and no image attributes")
        except PermissionError as e:
            _fail(path, "missing_file", f"unreadable: {e.strerror}")
        except (EOFError, struct.error) as e:
            _fail(path, "truncated", f"{type(e).__name__}: {e}")
    msgs = [str(w.message) for w in caught]
    if any("End of file reached" in m or "unexpected end" in m.lower() for m in msgs):
        _fail(path, "truncated", "end of file reached inside an element")
    return ds, msgs


def _int(ds, keyword, default=None):
    v = ds.get(keyword, default)
    if v is None or v == "":
        return default
    if isinstance(v, pydicom.multival.MultiValue):
        v = v[0]
    return int(v)


# What the predictor's outputs copy from an image (SR / presentation-state patient, study and
# evidence modules): the UIDs must be present (Type 1) and every value valid for its VR.
_REQUIRED_UIDS = ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID")
_CHECKED_VALUES = (*_REQUIRED_UIDS, "SOPClassUID", "PatientID", "PatientName",
                   "PatientBirthDate", "PatientSex", "AccessionNumber", "StudyID", "StudyDate",
                   "StudyTime", "ReferringPhysicianName", "StudyDescription")
# PS3.5 §6.2: LO, SH, PN, CS hold no control character but ESC (ISO 2022 escapes); UI none
_CONTROL = re.compile(r"[\x00-\x1a\x1c-\x1f\x7f]")


def _check_values(path, ds):
    """Refuse an image whose UIDs are missing or whose copied values are invalid for their VR
    (UI per PS3.5 §9; LO/SH/PN lengths, DA/TM forms: pydicom's validators; control
    characters), in one line naming the attribute and its VR, never its value."""
    with pydicom.config.disable_value_validation():  # pydicom's own warnings quote values
        for keyword in _REQUIRED_UIDS:
            if not _str(ds, keyword):
                _fail(path, "missing_uid", f"no {keyword} (Type 1): the image cannot be "
                                           "referenced")
        elems = [ds[k] for k in _CHECKED_VALUES if k in ds]
    for elem in elems:
        values = elem.value if isinstance(elem.value, pydicom.multival.MultiValue) else [
            elem.value]
        for v in values:
            text = "" if v is None else str(v)
            try:
                validate_value(elem.VR, text, pydicom.config.RAISE)
                ok = not (elem.VR in ("LO", "SH", "PN", "CS", "UI") and _CONTROL.search(text))
                why = "holds a control character"
            except ValueError as e:
                ok, why = False, ("is longer than its VR allows" if "length" in str(e) else
                                  "is not valid per PS3.5 §9" if elem.VR == "UI" else
                                  "is not valid for its VR")
            if not ok:
                _fail(path, "invalid_value", f"{elem.keyword} ({elem.VR}) {why}")


def _meta_from_ds(path, ds, allow_for_processing, check_values=False):
    modality = _str(ds, "Modality").upper()
    if modality and modality not in ALLOWED_MODALITIES:
        _fail(path, "wrong_modality", f"Modality {modality[:16]!r} not in {ALLOWED_MODALITIES}")
    intent = _str(ds, "PresentationIntentType").upper()
    if intent == "FOR PROCESSING" and not allow_for_processing:
        _fail(path, "for_processing", "PresentationIntentType FOR PROCESSING (raw detector data)")
    rows, cols = _int(ds, "Rows", 0), _int(ds, "Columns", 0)
    if not (0 < rows <= MAX_SIDE and 0 < cols <= MAX_SIDE) or rows * cols > MAX_PIXELS:
        _fail(path, "bad_dimensions", f"Rows x Columns = {rows} x {cols}")
    if check_values:
        _check_values(path, ds)
    res = _view_from_ds(ds)
    problem = res.problem
    raw_pid = patient_stem(_str(ds, "PatientID"))
    tsyntax = ds.file_meta.get("TransferSyntaxUID", "") if hasattr(ds, "file_meta") else ""
    return DicomMeta(
        path=str(path),
        laterality=res.laterality,
        view=res.view,
        study_uid=_str(ds, "StudyInstanceUID"),
        series_uid=_str(ds, "SeriesInstanceUID"),
        sop_uid=_str(ds, "SOPInstanceUID"),
        patient_id=pseudonymise(raw_pid) if raw_pid else "",
        modality=modality,
        rows=rows,
        cols=cols,
        photometric=_str(ds, "PhotometricInterpretation").upper(),
        presentation_intent=intent,
        transfer_syntax=str(tsyntax),
        exam_hint=_exam_hint(ds),
        view_problem=problem,
        view_note=res.note() if problem else "",
    )


def read_dicom_meta(path, allow_for_processing=False, check_values=False) -> DicomMeta:
    """Header-only read (no pixel data). Raises ``BadInputError`` on any problem.
    ``check_values``: also refuse missing UIDs and values invalid for their VR in what the
    predictor's DICOM outputs copy (``_check_values``; the predictor's reader sets it)."""
    path = os.fspath(path)
    ds = None
    try:
        ds, _ = _dcmread(path, stop_before_pixels=True)
        return _meta_from_ds(path, ds, allow_for_processing, check_values)
    except BadInputError as e:
        raise _scrubbed(e, ds) from None
    except Exception as e:  # noqa: BLE001 - malformed headers surface in many ways
        err = BadInputError(path, "unsupported", _one_line(f"{type(e).__name__}: {e}"))
        raise _scrubbed(err, ds) from None


def read_dicom_image(path, allow_for_processing=False):
    """Decode one mammogram to (float32 HxW in [0, 1], DicomMeta). Bright = dense tissue."""
    path = os.fspath(path)
    ds = None
    try:
        ds, _ = _dcmread(path, stop_before_pixels=False)
        meta = _meta_from_ds(path, ds, allow_for_processing)
        stored = _decode_stored(path, ds, meta)
        img = _to_unit_range(path, ds, stored, meta.photometric)
        return img, meta
    except BadInputError as e:
        raise _scrubbed(e, ds) from None
    except MemoryError:
        raise BadInputError(path, "bad_dimensions", "out of memory while decoding") from None
    except Exception as e:  # noqa: BLE001 - never crash on one bad file
        err = BadInputError(path, "unsupported", _one_line(f"{type(e).__name__}: {e}"))
        raise _scrubbed(err, ds) from None


def _decode_stored(path, ds, meta):
    """Checks that must pass before any pixel allocation, then decode the stored values."""
    if meta.photometric not in ("MONOCHROME1", "MONOCHROME2"):
        _fail(path, "unsupported",
              f"PhotometricInterpretation {meta.photometric[:16] or 'missing'}")
    if _int(ds, "SamplesPerPixel", 1) != 1:
        _fail(path, "unsupported", "SamplesPerPixel != 1")
    if min(meta.rows, meta.cols) < MIN_SIDE:
        _fail(path, "bad_dimensions", f"{meta.rows}x{meta.cols} image: smaller than "
                                      f"{MIN_SIDE}x{MIN_SIDE}, not a mammogram")
    _check_rescale(path, ds)
    frames = _int(ds, "NumberOfFrames", 1) or 1
    if frames != 1:
        _fail(path, "unsupported", f"multi-frame image ({frames} frames)")
    bits = _int(ds, "BitsAllocated", 0)
    if bits not in (8, 16):
        _fail(path, "unsupported", f"BitsAllocated {bits}")
    if "PixelData" not in ds:
        other = [k for k in ("FloatPixelData", "DoubleFloatPixelData") if k in ds]
        _fail(path, "unsupported" if other else "no_pixel_data", ", ".join(other))

    if not hasattr(ds, "file_meta") or "TransferSyntaxUID" not in ds.file_meta:
        # Forced read of a file without meta header: use the encoding it was parsed with.
        ds.file_meta = getattr(ds, "file_meta", None) or pydicom.dataset.FileMetaDataset()
        implicit = ds.original_encoding[0] if ds.original_encoding else True
        ds.file_meta.TransferSyntaxUID = (
            ImplicitVRLittleEndian if implicit else ExplicitVRLittleEndian)
    tsyntax = UID(str(ds.file_meta.TransferSyntaxUID))
    expected = meta.rows * meta.cols * (bits // 8)
    raw = ds.get_item("PixelData", keep_deferred=True)
    file_size = os.path.getsize(path)

    if not tsyntax.is_transfer_syntax:
        _fail(path, "undecodable", f"unknown transfer syntax {tsyntax}")
    if not tsyntax.is_encapsulated:
        declared = getattr(raw, "length", None)
        if declared is not None and getattr(raw, "value_tell", None) is not None:
            if raw.value_tell + declared > file_size:
                _fail(path, "truncated", f"pixel data declares {declared} bytes, file ends "
                                         f"after {file_size - raw.value_tell}")
        nbytes = len(ds.PixelData)
        if nbytes < expected:
            _fail(path, "bad_dimensions",
                  f"pixel data has {nbytes} bytes, {meta.rows}x{meta.cols}x{bits}bit needs "
                  f"{expected}")
    else:
        try:
            decoder = get_decoder(tsyntax)
        except NotImplementedError:
            decoder = None
        if decoder is None or not decoder.is_available:
            _fail(path, "undecodable", f"{tsyntax.name} ({tsyntax}): no decoder installed"
                                       + _missing_plugins(decoder))
        nbytes = len(ds.PixelData)
        if expected > (64 << 20) and expected > MAX_COMPRESSION_RATIO * nbytes:
            _fail(path, "bad_dimensions", f"{meta.rows}x{meta.cols} from {nbytes} compressed "
                                          "bytes (decompression bomb?)")
        if tsyntax in JPEG2000TransferSyntaxes:
            _check_j2k_size(path, ds.PixelData, meta.rows, meta.cols)
        elif tsyntax in JPEGTransferSyntaxes or tsyntax in JPEGLSTransferSyntaxes:
            _check_jpeg_size(path, ds.PixelData, meta.rows, meta.cols)

    # pylibjpeg (openjpeg) for JPEG 2000: exact for 15/16-bit lossless; JPEG Lossless and
    # JPEG-LS go to pydicom's default (GDCM). RLE: only pydicom's own decoder (pydicom falls
    # back to the next plugin when one fails, and pylibjpeg-rle, if installed, panics with a
    # BaseException on malformed data).
    plugin = ""
    if tsyntax == RLELossless:
        plugin = "pydicom"
    elif tsyntax.is_encapsulated and "pylibjpeg" in get_decoder(tsyntax).available_plugins:
        plugin = "pylibjpeg"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            arr = pixel_array(ds, decoding_plugin=plugin) if plugin else ds.pixel_array
        except (EOFError, struct.error) as e:
            _fail(path, "truncated", f"{type(e).__name__}: {e}")
        except MemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - codec errors have many types
            reason = "undecodable" if tsyntax.is_encapsulated else "unsupported"
            _fail(path, reason, f"{tsyntax.name}: {type(e).__name__}: {e}")
    if any("End of file" in str(w.message) for w in caught):
        _fail(path, "truncated", "end of file inside pixel data")
    if arr.shape != (meta.rows, meta.cols):
        _fail(path, "bad_dimensions", f"decoded shape {arr.shape} != ({meta.rows}, {meta.cols})")
    if not np.issubdtype(arr.dtype, np.integer):
        _fail(path, "unsupported", f"non-integer pixel data {arr.dtype}")
    return arr


def _missing_plugins(decoder):
    """' (needs X or Y)': what pydicom says would decode it (e.g. pylibjpeg-libjpeg, gdcm)."""
    needs = [m.split(" - requires ", 1)[-1] for m in
             getattr(decoder, "missing_dependencies", None) or []]
    return f" (needs {' or '.join(needs)})" if needs else ""


# Start-of-frame markers of ISO 10918 (JPEG: baseline, extended, lossless, ...) and SOF55 of
# ISO 14495 (JPEG-LS); DHT/JPG/DAC (C4, C8, CC) share the range but are not frame headers.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC} | {0xF7}


def _codestream_head(path, pixel_data, limit=1 << 16):
    """Up to ``limit`` bytes of the frame's data: its fragments in order after the Basic Offset
    Table, empty ones skipped, so a header split across fragments or placed after empty ones is
    still found. Copies at most ``limit`` bytes; malformed items are one bad-input line."""
    buf = io.BytesIO(pixel_data)
    head, n = [], 0
    try:
        parse_basic_offsets(buf)
        for fragment in generate_fragments(buf):
            head.append(fragment[:limit - n])
            n += len(head[-1])
            if n >= limit:
                break
    except (ValueError, struct.error) as e:
        _fail(path, "undecodable", f"malformed encapsulated pixel data: {e}")
    return b"".join(head)


def _check_jpeg_size(path, pixel_data, rows, cols):
    """The JPEG / JPEG-LS frame header (SOF) must agree with Rows/Columns: the codec allocates
    by the SOF, so a crafted one could ask for gigabytes before any other check."""
    b = _codestream_head(path, pixel_data)
    if b[:2] != b"\xff\xd8":  # no SOI: let the decoder judge
        return
    i = 2
    while i + 4 <= len(b):
        if b[i] != 0xFF:
            return
        marker = b[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # TEM, RSTn: no length
            i += 2
            continue
        if marker in _JPEG_SOF:
            if i + 9 > len(b):
                return
            lines, width = struct.unpack(">HH", b[i + 5:i + 9])
            # lines == 0: the height comes later in a DNL marker (ISO 10918 B.2.5)
            if width != cols or lines not in (0, rows):
                _fail(path, "bad_dimensions", f"JPEG frame header is {width}x{lines}, header "
                                              f"says {cols}x{rows}")
            return
        if marker == 0xDA:  # start of scan without a frame header
            return
        i += 2 + int.from_bytes(b[i + 2:i + 4], "big")


def _check_j2k_size(path, pixel_data, rows, cols):
    """The J2K SIZ marker (wherever the codestream starts in the fragments) must agree with
    Rows/Columns and declare one component of <= 16 bits: the codec allocates by SIZ, so without
    it nothing bounds the memory of a crafted file. No SIZ found: refused, not decoded."""
    head = _codestream_head(path, pixel_data)
    i = head.find(b"\xff\x4f\xff\x51")  # SOC + SIZ
    if i < 0 or i + 43 > len(head):
        _fail(path, "undecodable", "no JPEG 2000 SIZ marker in the first 64 KB of the codestream")
    xsiz, ysiz, xo, yo = struct.unpack(">IIII", head[i + 8:i + 24])
    components, depth = struct.unpack(">HB", head[i + 40:i + 43])
    if (xsiz - xo, ysiz - yo) != (cols, rows):
        _fail(path, "bad_dimensions",
              f"JPEG 2000 codestream is {xsiz - xo}x{ysiz - yo}, header says {cols}x{rows}")
    if components != 1 or (depth & 0x7F) + 1 > 16:
        _fail(path, "unsupported", f"JPEG 2000 codestream has {components} components of "
                                   f"{(depth & 0x7F) + 1} bits (expected 1 grey channel)")


def _check_rescale(path, ds):
    """Slope 0 / NaN / +-1e308 or an infinite intercept: refused (it would give a black image)."""
    for key, default in (("RescaleSlope", 1.0), ("RescaleIntercept", 0.0)):
        raw = ds.get(key, None)
        try:
            value = default if raw is None or raw == "" else float(raw)
        except (TypeError, ValueError):
            _fail(path, "bad_intensity", f"{key} {str(raw)[:32]!r} is not a number")
        lo, hi = _SLOPE_RANGE if key == "RescaleSlope" else (0.0, _INTERCEPT_MAX)
        if not (np.isfinite(value) and lo <= abs(value) <= hi):
            _fail(path, "bad_intensity", f"{key} {value!r} outside [{lo:g}, {hi:g}] in magnitude")


def _padding_mask_values(ds, lo, hi):
    """Stored values (as indices into [lo, hi]) that are PixelPaddingValue (or its range)."""
    pad = ds.get("PixelPaddingValue", None)
    if pad is None or isinstance(pad, (bytes, bytearray)):
        return None
    pad = int(pad[0] if isinstance(pad, pydicom.multival.MultiValue) else pad)
    limit = ds.get("PixelPaddingRangeLimit", None)
    limit = pad if limit is None or isinstance(limit, (bytes, bytearray)) else int(limit)
    a, b = min(pad, limit), max(pad, limit)
    a, b = max(a, lo), min(b, hi)
    if a > b:
        return None
    return np.arange(a - lo, b - lo + 1)


def _voi_output_range(ds):
    """(low, high) output values of the VOI stage, to map it to [0, 1]."""
    seq = ds.get("VOILUTSequence", None)
    if seq and seq[0].get("LUTDescriptor") is not None and seq[0].get("LUTData") is not None:
        lut = np.asarray(seq[0].LUTData, dtype=np.float64).ravel()
        return float(lut.min()), float(lut.max())
    # Window: probe the same function far outside the window -> its saturation values.
    with np.errstate(over="ignore"):
        probe = apply_voi_lut(np.array([-1e12, 1e12]), ds)
    return float(probe[0]), float(probe[1])


def _has_voi(ds):
    seq = ds.get("VOILUTSequence", None)
    if seq and seq[0].get("LUTDescriptor") is not None and seq[0].get("LUTData") is not None:
        return True
    return ds.get("WindowCenter", None) is not None and ds.get("WindowWidth", None) is not None


def _to_unit_range(path, ds, stored, photometric):
    """Intensity pipeline as a lookup table over the stored-value range (fast, exact)."""
    lo, hi = int(stored.min()), int(stored.max())
    if hi - lo + 1 > _LUT_MAX_ENTRIES:
        _fail(path, "unsupported", f"stored value range {lo}..{hi} too wide")
    values = np.arange(lo, hi + 1, dtype=np.int64)
    idx = stored.astype(np.int32) - lo if lo else stored
    pad_idx = _padding_mask_values(ds, lo, hi)

    modality = np.asarray(apply_modality_lut(values, ds), dtype=np.float64)
    if not np.isfinite(modality).all():  # e.g. a Modality LUT with absurd entries
        _fail(path, "bad_intensity", "the modality LUT gives non-finite values")
    lut = None
    if _has_voi(ds):
        # A VOI LUT indexes by value: give it integers when the modality output is integral.
        voi_in = modality.astype(np.int64) if np.all(modality == np.rint(modality)) else modality
        try:
            voi = np.asarray(apply_voi_lut(voi_in, ds, index=0), dtype=np.float64)
            y0, y1 = _voi_output_range(ds)
            if y1 != y0 and np.isfinite([y0, y1]).all():
                lut = (voi - y0) / (y1 - y0)
        except (ValueError, IndexError, TypeError, AttributeError) as e:
            # Invalid window (e.g. width 0): fall back to the percentile window, keep going.
            logger.warning("%s: invalid VOI (%s); using percentile scaling", path, _one_line(e))
    if lut is None:
        counts = np.bincount(idx.ravel(), minlength=values.size).astype(np.float64)
        if pad_idx is not None:
            counts[pad_idx] = 0
        order = np.argsort(modality, kind="stable")
        cdf = np.cumsum(counts[order])
        if cdf[-1] > 0:
            p0 = modality[order][np.searchsorted(cdf, 0.005 * cdf[-1])]
            p1 = modality[order][min(np.searchsorted(cdf, 0.995 * cdf[-1]), values.size - 1)]
        else:
            p0, p1 = modality.min(), modality.max()
        lut = (modality - p0) / max(p1 - p0, 1e-12)
    lut = np.clip(lut, 0.0, 1.0)
    if photometric == "MONOCHROME1":  # low values are bright: invert so tissue is bright
        lut = 1.0 - lut
    if pad_idx is not None:
        lut[pad_idx] = 0.0
    return lut.astype(np.float32)[idx]


def write_dicom(path, pixels, *, photometric="MONOCHROME2", bits_stored=None,
                transfer_syntax=ExplicitVRLittleEndian, **attrs):
    """Write a small valid mammogram DICOM (tests, benchmarks, synthetic data).

    ``pixels``: uint8/uint16 HxW stored values. ``attrs``: DICOM keywords (e.g. Modality="MG",
    ImageLaterality="L", ViewPosition="CC", WindowCenter=..., PatientID=...); ``None`` deletes.
    A compressed ``transfer_syntax`` (e.g. JPEG2000Lossless) is encoded with pydicom's encoders.
    """
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import generate_uid

    pixels = np.ascontiguousarray(pixels)
    if pixels.dtype not in (np.uint8, np.uint16, np.int16):
        raise ValueError(f"pixels must be uint8/uint16/int16, got {pixels.dtype}")
    bits = pixels.dtype.itemsize * 8
    sop_class = "1.2.840.10008.5.1.4.1.1.1.2"  # Digital Mammography X-Ray Image - Presentation
    ds = Dataset()
    ds.file_meta = FileMetaDataset()
    ds.file_meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds.file_meta.MediaStorageSOPClassUID = sop_class
    ds.file_meta.MediaStorageSOPInstanceUID = generate_uid()
    ds.SOPClassUID = sop_class
    ds.SOPInstanceUID = ds.file_meta.MediaStorageSOPInstanceUID
    ds.StudyInstanceUID = generate_uid()
    ds.SeriesInstanceUID = generate_uid()
    ds.Modality = "MG"
    ds.PatientID = "SYNTHETIC"
    ds.PresentationIntentType = "FOR PRESENTATION"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated = bits
    ds.BitsStored = bits_stored or bits
    ds.HighBit = ds.BitsStored - 1
    ds.PixelRepresentation = 1 if pixels.dtype == np.int16 else 0
    ds.PixelData = pixels.tobytes()
    for k, v in attrs.items():
        if v is None:
            if k in ds:
                delattr(ds, k)
        else:
            setattr(ds, k, v)
    tsyntax = UID(str(transfer_syntax))
    if tsyntax.is_compressed:
        ds.compress(tsyntax)
    else:
        ds.file_meta.TransferSyntaxUID = tsyntax
    ds.save_as(os.fspath(path), enforce_file_format=True)
    return os.fspath(path)
