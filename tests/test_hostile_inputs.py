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
