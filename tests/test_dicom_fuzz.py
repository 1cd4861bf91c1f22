"""Fuzzing the DICOM reader: >= 200 mutated files, zero crashes or hangs, one-line errors.

Mutants derive (seeded) from small valid MG files (native, JPEG 2000, RLE) written here. The
read loop runs in a subprocess (a native-codec crash cannot take pytest down) with a 5 s
``signal.alarm`` per file and an overall timeout.
"""
import json
import os
import struct
import subprocess
import sys
import textwrap
import tracemalloc

import numpy as np
import pydicom
import pytest
from pydicom.encaps import encapsulate
from pydicom.uid import JPEG2000Lossless, RLELossless

from braixdet.data.dicom import read_dicom_image, read_dicom_meta, write_dicom
from braixdet.data.report import BadInputError

SEED = 1234
N_PER_KIND = 25  # 9 kinds -> 225 mutants


def _base_files(d):
    rng = np.random.default_rng(SEED)
    px = np.zeros((64, 48), np.uint16)
    px[8:56, :30] = rng.integers(800, 3000, (48, 30))
    common = dict(bits_stored=12, WindowCenter=1500.0, WindowWidth=2000.0, ImageLaterality="L",
                  ViewPosition="CC", PatientID="FUZZ-ID-77", PatientName="Fuzz^Patient",
                  PatientBirthDate="19610203")
    return {
        "native": write_dicom(d / "base_native.dcm", px, **common),
        "j2k": write_dicom(d / "base_j2k.dcm", px, transfer_syntax=JPEG2000Lossless, **common),
        "rle": write_dicom(d / "base_rle.dcm", px, transfer_syntax=RLELossless, **common),
    }


def _element_offsets(data, tags):
    """Byte offsets of explicit-VR-LE element headers (group, elem) found in the stream."""
    out = []
    for g, e in tags:
        i = data.find(struct.pack("<HH", g, e))
        if i >= 0:
            out.append(i)
    return out


_TAGS = [(0x0028, 0x0010), (0x0028, 0x0011), (0x0028, 0x0100), (0x0028, 0x0101),
         (0x0028, 0x0004), (0x0008, 0x0060), (0x7FE0, 0x0010), (0x0028, 0x1050),
         (0x0002, 0x0010), (0x0020, 0x0062), (0x0008, 0x0016)]
_DELETABLE = ["Rows", "Columns", "PixelData", "Modality", "BitsAllocated", "BitsStored",
              "PhotometricInterpretation", "SamplesPerPixel", "WindowWidth",
              "PixelRepresentation", "SOPClassUID"]
_ABSURD = [("Rows", 60000), ("Columns", 65535), ("Rows", 0), ("Columns", 1),
           ("BitsAllocated", 7), ("BitsAllocated", 32), ("BitsStored", 40), ("HighBit", 99),
           ("SamplesPerPixel", 3), ("NumberOfFrames", "1000000"), ("WindowWidth", 0.0),
           ("WindowWidth", -50.0), ("PixelRepresentation", 1), ("PixelPaddingValue", 65535),
           ("RescaleSlope", 0.0), ("VOILUTFunction", "BOGUS"), ("Rows", 20000),
           ("PhotometricInterpretation", "YBR_FULL")]


def make_mutants(d, n_per_kind=N_PER_KIND):
    rng = np.random.default_rng(SEED)
    bases = _base_files(d)
    raw = {k: open(p, "rb").read() for k, p in bases.items()}
    out = []

    def emit(name, data):
        p = d / f"m{len(out):04d}_{name}.dcm"
        p.write_bytes(data)
        out.append(p)

    for kind, data in raw.items():  # bit flips and truncation on every encoding
        for _ in range(n_per_kind):
            b = bytearray(data)
            for pos in rng.integers(0, len(b), rng.integers(1, 40)):
                b[pos] ^= 1 << int(rng.integers(0, 8))
            emit(f"flip_{kind}", bytes(b))
        for _ in range(n_per_kind // 2 + 1):
            emit(f"trunc_{kind}", data[: int(rng.integers(0, len(data)))])
    native = raw["native"]
    offs = _element_offsets(native, _TAGS)
    for _ in range(n_per_kind):  # wrong element lengths (explicit VR: 16- or 32-bit length)
        b = bytearray(native)
        o = int(rng.choice(offs))
        vr = bytes(b[o + 4:o + 6])
        if vr in (b"OB", b"OW", b"SQ", b"UN", b"UT", b"UC", b"UR"):
            b[o + 8:o + 12] = struct.pack("<I", int(rng.integers(0, 2**32)))
        else:
            b[o + 6:o + 8] = struct.pack("<H", int(rng.integers(0, 2**16)))
        emit("len", bytes(b))
    for i in range(n_per_kind):  # missing tags
        ds = pydicom.dcmread(bases["native"])
        for k in rng.choice(_DELETABLE, size=1 + i % 3, replace=False):
            if k in ds:
                delattr(ds, k)
        if i % 5 == 0:
            del ds.file_meta.TransferSyntaxUID
        p = d / f"m{len(out):04d}_missing.dcm"
        ds.save_as(p, enforce_file_format=False)
        out.append(p)
    for i in range(n_per_kind):  # absurd values (on native and compressed bases)
        src = bases["native"] if i % 2 == 0 else bases["j2k"]
        ds = pydicom.dcmread(src)
        for k, v in [_ABSURD[j] for j in rng.choice(len(_ABSURD), 1 + i % 2, replace=False)]:
            setattr(ds, k, v)
            if " or " in ds[k].VR:  # e.g. 'US or SS': pick one so it can be written
                ds[k].VR = ds[k].VR.split(" or ")[0]
        p = d / f"m{len(out):04d}_absurd.dcm"
        ds.save_as(p, enforce_file_format=False)
        out.append(p)
    for i in range(n_per_kind):  # garbage: random bytes, with or without a DICM preamble
        junk = rng.integers(0, 256, int(rng.integers(0, 3000)), dtype=np.uint8).tobytes()
        emit("junk", (b"\0" * 128 + b"DICM" + junk) if i % 2 else junk)
    return out


RUNNER = textwrap.dedent("""
    import json, signal, sys, traceback, warnings
    warnings.simplefilter("ignore")
    from braixdet.data.dicom import read_dicom_image, read_dicom_meta
    from braixdet.data.report import BadInputError, BadInputReport

    class Hang(Exception):
        pass

    def on_alarm(*_):
        raise Hang()

    signal.signal(signal.SIGALRM, on_alarm)
    paths, out = sys.argv[1:-1], sys.argv[-1]
    report = BadInputReport("fuzz")
    res = []
    for p in paths:
        for fn in (read_dicom_meta, read_dicom_image):
            r = {"path": p, "fn": fn.__name__}
            signal.alarm(5)
            try:
                fn(p)
                r["ok"] = True
            except BadInputError as e:
                report.add(e)
                r.update(ok=False, reason=e.reason, msg=str(e))
            except Hang:
                r.update(hang=True)
            except BaseException as e:  # a crash: anything but BadInputError
                r.update(crash=type(e).__name__ + ": " + str(e)[:200],
                         tb=traceback.format_exc()[-800:])
            finally:
                signal.alarm(0)
            res.append(r)
    report.save(out + ".report.json")
    json.dump(res, open(out, "w"))
""")


def test_fuzzed_dicoms_never_crash_or_hang(tmp_path):
    mutants = make_mutants(tmp_path)
    assert len(mutants) >= 200
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-c", RUNNER, *map(str, mutants), str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.load(open(out))
    assert len(res) == 2 * len(mutants)
    crashes = [r for r in res if "crash" in r]
    hangs = [r for r in res if r.get("hang")]
    assert not crashes, crashes[:3]
    assert not hangs, hangs[:3]
    failures = [r for r in res if r.get("ok") is False]
    for r in failures:
        assert "\n" not in r["msg"] and r["path"] in r["msg"], r
        # identifiers never leak, even when a broken length makes an element swallow them
        for ident in ("FUZZ-ID", "Fuzz^Patient", "19610203"):
            assert ident not in r["msg"], r
    report = json.load(open(str(out) + ".report.json"))
    assert report["num_bad"] == len(failures) == sum(report["counts"].values())
    reasons = set(report["counts"])
    # the mutation kinds really exercise the error paths
    assert {"not_dicom", "truncated", "bad_dimensions"} <= reasons, reasons
    assert len(failures) > len(mutants) // 2


def _peak_mib(fn):
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak / 2**20


@pytest.mark.parametrize("rows,cols,encap", [
    (20000, 20000, False),  # beyond MAX_PIXELS
    (9000, 9000, False),  # plausible grid, tiny native buffer
    (9000, 9000, True),  # plausible grid, tiny compressed stream (ratio check)
])
def test_decompression_bomb_refused_before_allocation(tmp_path, rows, cols, encap):
    p = write_dicom(tmp_path / "b.dcm", np.zeros((64, 64), np.uint16),
                    transfer_syntax=JPEG2000Lossless if encap else "1.2.840.10008.1.2.1")
    ds = pydicom.dcmread(p)
    ds.Rows, ds.Columns = rows, cols
    ds.save_as(p, enforce_file_format=True)

    def read():
        with pytest.raises(BadInputError) as ei:
            read_dicom_image(p)
        assert ei.value.reason == "bad_dimensions"

    assert _peak_mib(read) < 16  # the decoded grid would be >= 150 MiB


def _j2k_codestream(path):
    """A 64x64 JPEG 2000 DICOM at ``path``: (dataset, its codestream, offset of SOC+SIZ)."""
    write_dicom(path, np.zeros((64, 64), np.uint16), transfer_syntax=JPEG2000Lossless)
    ds = pydicom.dcmread(path)
    code = bytearray(next(pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=1)))
    return ds, code, code.find(b"\xff\x4f\xff\x51")


def test_j2k_codestream_larger_than_header_refused(tmp_path):
    """The codec allocates by the J2K SIZ marker: it must agree with Rows/Columns."""
    p = tmp_path / "s.dcm"
    ds, frag, i = _j2k_codestream(p)
    frag[i + 8:i + 16] = struct.pack(">II", 30000, 30000)  # Xsiz, Ysiz
    ds.PixelData = encapsulate([bytes(frag)])
    ds.save_as(p, enforce_file_format=True)
    with pytest.raises(BadInputError) as ei:
        read_dicom_image(p)
    assert ei.value.reason == "bad_dimensions" and "JPEG 2000" in ei.value.detail
    read_dicom_meta(p)  # header alone is fine
    assert os.path.getsize(p) < 10000


# ------------------------------------------------------------------ JPEG 2000 fragment layouts
def _j2k_layouts(tmp_path, claimed):
    """{layout: path} of 256x256-header J2K files whose codestream claims ``claimed`` x
    ``claimed``: the SIZ after 600 empty fragments (beyond the first 4 KB, like the issue's
    7.4 KB bomb), split across fragments, behind a Basic Offset Table with an offset."""
    from pydicom.encaps import itemize_fragment

    p = write_dicom(tmp_path / "base.dcm", np.zeros((256, 256), np.uint16),
                    transfer_syntax=JPEG2000Lossless)
    ds = pydicom.dcmread(p)
    code = bytearray(next(pydicom.encaps.generate_frames(ds.PixelData, number_of_frames=1)))
    i = code.find(b"\xff\x4f\xff\x51")
    code[i + 8:i + 16] = struct.pack(">II", claimed, claimed)  # Xsiz, Ysiz
    code = bytes(code)

    def items(frags, bot=b""):
        return itemize_fragment(bot) + b"".join(itemize_fragment(f) for f in frags)

    layouts = {
        "empty_fragments_first": items([b""] * 600 + [code]),
        "siz_split_across_fragments": items([code[:i + 10], code[i + 10:i + 30], code[i + 30:]]),
        "offset_table": items([code[:7], code[7:]], bot=struct.pack("<I", 0)),
    }
    out = {}
    for name, pixel_data in layouts.items():
        ds.PixelData = pixel_data
        ds["PixelData"].is_undefined_length = True
        out[name] = tmp_path / f"{name}.dcm"
        ds.save_as(out[name], enforce_file_format=True)
    return out


@pytest.mark.parametrize("layout", ["empty_fragments_first", "siz_split_across_fragments",
                                    "offset_table"])
def test_j2k_size_bomb_found_in_any_fragment_layout(tmp_path, monkeypatch, layout):
    """Issue 21 item 2: the SIZ is found wherever the fragments put it and checked before the
    decoder runs (a decoder call here would be a 19000x19000 frame, 2.8 GB)."""
    from braixdet.data import dicom

    path = _j2k_layouts(tmp_path, 19000)[layout]
    assert os.path.getsize(path) < 12000

    def decoder_called(*a, **k):
        raise AssertionError("the decoder ran on a size bomb")

    monkeypatch.setattr(dicom, "pixel_array", decoder_called)
    with pytest.raises(BadInputError) as ei:
        read_dicom_image(path)
    assert ei.value.reason == "bad_dimensions", ei.value
    assert "JPEG 2000 codestream is 19000x19000, header says 256x256" in str(ei.value)


def test_j2k_fragment_layouts_of_a_valid_stream_decode(tmp_path):
    """The same layouts with a truthful SIZ decode to the written pixels, memory bounded."""
    for name, path in _j2k_layouts(tmp_path, 256).items():
        img, _ = read_dicom_image(path)
        assert img.shape == (256, 256), name
        assert _peak_mib(lambda p=path: read_dicom_image(p)) < 16, name


def test_j2k_without_siz_or_with_many_components_refused(tmp_path):
    ds, code, i = _j2k_codestream(tmp_path / "b.dcm")
    many = bytearray(code)
    many[i + 40:i + 42] = struct.pack(">H", 16384)  # Csiz: 16384 components
    for name, frags, reason in [("junk", [b"\x00" * 70000, bytes(code)], "undecodable"),
                                ("components", [bytes(many)], "unsupported")]:
        ds.PixelData = encapsulate(frags)
        ds.save_as(tmp_path / f"{name}.dcm", enforce_file_format=True)
        with pytest.raises(BadInputError) as ei:
            read_dicom_image(tmp_path / f"{name}.dcm")
        assert ei.value.reason == reason, (name, ei.value)
