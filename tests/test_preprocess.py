"""Canonicalisation: mask drops text/markers, crop keeps the breast, flip, exact box round trip."""
import json
import logging
import os

import cv2
import numpy as np
import pytest

from braixdet.data.preprocess import (
    PreprocessParams,
    canonicalize,
    transform_from_dict,
    transform_to_dict,
)
from braixdet.data.report import BadInputError

H, W = 400, 330
PARAMS = PreprocessParams(canonical_size=(128, 64), margin=0.02, downsample=4)


def synth(side="left", seed=0, h=H, w=W):
    """Mammogram-like image: half ellipse on the chest-wall side + burned-in text + marker."""
    rng = np.random.default_rng(seed)
    img = np.clip(rng.normal(0.03, 0.01, (h, w)), 0, 1).astype(np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    cx = 0 if side == "left" else w - 1
    r = np.hypot((yy - h * 0.55) / (0.38 * h), (xx - cx) / (0.55 * w))
    img[r < 1] = 0.45 + 0.35 * (1 - r[r < 1])
    far = (w - 90, 8) if side == "left" else (5, 8)  # text in the corner away from the breast
    txt = np.zeros((h, w), np.uint8)
    cv2.putText(txt, "LCC", (far[0], far[1] + 20), cv2.FONT_HERSHEY_SIMPLEX, 0.8, 255, 2)
    text = txt > 0
    img[text] = 1.0
    marker = np.zeros((h, w), bool)
    mx = w - 30 if side == "left" else 10
    marker[h - 30:h - 14, mx:mx + 16] = True
    img[marker] = 0.95
    return img, text, marker, r < 1


@pytest.mark.parametrize("side,lat", [("left", "L"), ("right", "R")])
def test_canonical_shape_flip_and_cleaning(side, lat):
    img, text, marker, breast = synth(side)
    out, tfm, info = canonicalize(img, lat, PARAMS)
    assert out.shape == (128, 64) and out.dtype == np.float32
    assert 0.0 <= out.min() and out.max() <= 1.0
    assert info["flip"] == (side == "right") and not info["laterality_disagreement"]
    # chest wall on the left: left columns carry more tissue than right ones
    assert out[:, :16].sum() > 2 * out[:, -16:].sum()
    # the crop contains the whole breast: its bounding box maps inside the canonical frame
    ys, xs = np.nonzero(breast)
    b = tfm.apply_box(np.array([[xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]], float))[0]
    assert b[0] >= -1 and b[1] >= -1 and b[2] <= 64 + 1 and b[3] <= 128 + 1
    # text and marker are zeroed: apply the same geometry to their masks
    for region in (text, marker):
        warped = tfm.apply_image(region.astype(np.float32))
        assert warped.sum() == 0 or out[warped > 0.5].max() < 0.05


def test_text_and_marker_zeroed_inside_crop():
    """A marker inside the crop box (but outside the breast) must also be zeroed."""
    img, _, _, _ = synth("left")
    img[75:85, 145:155] = 1.0  # inside the breast's bounding box, outside the breast
    crop_only = PreprocessParams(canonical_size=(400, 200), margin=0.0, downsample=4)
    out, tfm, _ = canonicalize(img, "L", crop_only)
    box = tfm.apply_box(np.array([[145, 75, 155, 85]], float))[0]
    x0, y0, x1, y1 = (int(round(v)) for v in box)
    assert y1 > y0 and x1 > x0 and out[y0:y1, x0:x1].max() < 0.05


def test_image_decides_on_laterality_disagreement(caplog):
    img, *_ = synth("right")
    caplog.set_level(logging.WARNING)
    _, _, info = canonicalize(img, "L", PARAMS)
    assert info["flip"] and info["laterality_disagreement"]
    assert "laterality" in caplog.text


def test_ambiguous_image_uses_laterality():
    img = np.zeros((200, 100), np.float32)
    img[20:180, 20:80] = 0.7  # symmetric block: the image cannot tell
    for lat, flip in (("L", False), ("R", True)):
        _, _, info = canonicalize(img, lat, PARAMS)
        assert info["flip"] == flip and info["flip_source"] == "laterality"


def _film(strips):
    """A breast whose chest-wall side spans the whole height (as an MLO) on a 'film' with the
    given bright edge strips: {"top"|"bottom"|"far": depth in pixels} (far: the side away
    from the chest wall), 0.9 bright, as scanned films have."""
    h, w = 400, 320
    img = np.full((h, w), 0.03, np.float32)
    yy, xx = np.mgrid[0:h, 0:w]
    r = np.hypot((yy - h * 0.5) / (0.62 * h), xx / (0.45 * w))
    img[r < 1] = 0.5
    for where, depth in strips.items():
        region = {"top": np.s_[:depth, :], "bottom": np.s_[h - depth:, :],
                  "far": np.s_[:, w - depth:]}[where]
        img[region] = 0.9
    return img


@pytest.mark.parametrize("strips", [{"top": 6}, {"bottom": 12}, {"top": 4, "far": 8},
                                    {"top": 8, "bottom": 8, "far": 4}])
def test_film_edge_strips_are_not_breast(strips):
    """Strips touching the breast made the whole film one component (issue 19's right MLO):
    the crop must be the clean film's crop (within 2 mask pixels of 4 px), less at most the
    rows under a top/bottom strip (they are film edge)."""
    params = PreprocessParams(canonical_size=(128, 64), margin=0.0, downsample=4)
    x0, y0, cw, ch = canonicalize(_film({}), "L", params)[2]["crop"]
    cx0, cy0, ccw, cch = canonicalize(_film(strips), "L", params)[2]["crop"]
    assert cw < 0.6 * 320 and (x0, y0, ch) == (0, 0, 400)  # the breast: narrow, full height
    assert cx0 == 0 and abs(ccw - cw) <= 8, (ccw, cw)
    top, bottom = strips.get("top", 0), strips.get("bottom", 0)
    assert cy0 <= top + 8 and cy0 + cch >= 400 - bottom - 8


@pytest.mark.parametrize("side", ["left", "right"])
def test_box_round_trip_within_one_pixel(side):
    img, *_ = synth(side, seed=3)
    _, tfm, info = canonicalize(img, "L" if side == "left" else "R", PARAMS)
    assert info["crop"] != [0, 0, W, H]  # non-trivial crop
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, [W, H], size=(200, 2))
    wh = rng.uniform(2, 120, size=(200, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1)
    fwd = tfm.apply_box(boxes.copy())
    back = tfm.inverse().apply_box(fwd.copy())
    np.testing.assert_allclose(back, boxes, atol=1.0)
    # through JSON too
    tfm2 = transform_from_dict(json.loads(json.dumps(transform_to_dict(tfm))))
    np.testing.assert_allclose(tfm2.apply_box(boxes.copy()), fwd, atol=1e-6)
    np.testing.assert_allclose(tfm2.inverse().apply_box(fwd.copy()), boxes, atol=1.0)


def test_transform_dict_round_trip_and_geometry():
    img, *_ = synth("right")
    out, tfm, info = canonicalize(img, "R", PARAMS)
    d = transform_to_dict(tfm)
    assert d == transform_to_dict(transform_from_dict(d))
    names = [t["type"] for t in d["transforms"]]
    assert names == ["CropTransform", "HFlipTransform", "PadTransform", "ResizeTransform"]
    # padded size has the canonical aspect H/W = 2
    rs = d["transforms"][-1]
    assert rs["h"] / rs["w"] == pytest.approx(2.0, abs=2.0 / rs["w"])
    # detectron2's apply_image with the deserialised transform gives the same picture inside
    # the breast (it differs only by masking and interpolation)
    again = transform_from_dict(d).apply_image(img)
    assert again.shape == out.shape
    inside = out > 0.5
    assert inside.mean() > 0.2 and np.median(np.abs(again - out)[inside]) < 0.02


def test_params_key_stable_and_distinct():
    assert PreprocessParams().key() == PreprocessParams().key()
    assert PreprocessParams().key() != PreprocessParams(canonical_size=(1024, 512)).key()
    with pytest.raises(ValueError):
        PreprocessParams(canonical_size=(0, 10))


# ------------------------------------------------------------------ cache + prepare tool
def _mammo_dicom(path, side="left", seed=0):
    from braixdet.data.dicom import write_dicom

    img, *_ = synth(side, seed)
    return write_dicom(path, (img * 4000).astype(np.uint16), bits_stored=12,
                       ImageLaterality="L" if side == "left" else "R")


@pytest.mark.parametrize("fmt", ["npy", "png"])
def test_cache_computes_once_and_never_writes_beside_input(tmp_path, fmt):
    from braixdet.data.cache import CanonicalCache
    from braixdet.data.dicom import read_dicom_image

    data = tmp_path / "data"
    data.mkdir()
    p = _mammo_dicom(data / "a.dcm", "right")
    cache = CanonicalCache(tmp_path / "cache", PARAMS, fmt=fmt)
    img, tfm = cache.get(p, "R")
    assert img.shape == (128, 64) and img.dtype == np.float32 and tfm.transforms
    assert sorted(os.listdir(data)) == ["a.dcm"]
    stem = cache.entry_path(p, "R")
    ext = "." + fmt
    assert os.path.exists(stem + ext) and os.path.exists(stem + ".json")
    assert PARAMS.key() in stem and not [f for f in os.listdir(os.path.dirname(stem))
                                         if f.startswith(".tmp")]
    mtime = os.path.getmtime(stem + ext)
    img2, tfm2 = cache.get(p, "R")  # hit: bit-identical, nothing rewritten
    assert np.array_equal(img, img2) and os.path.getmtime(stem + ext) == mtime
    assert transform_to_dict(tfm) == transform_to_dict(tfm2)
    # equals a fresh computation up to 16-bit quantisation
    ref, _, _ = canonicalize(read_dicom_image(p)[0], "R", PARAMS)
    assert np.abs(ref - img).max() <= 1 / 65535 + 1e-7
    # another parameter set -> another folder; a bad file -> BadInputError, no entry
    other = CanonicalCache(tmp_path / "cache", PreprocessParams((64, 32), 0.02, 4))
    assert other.entry_path(p, "R") != stem
    (data / "bad.dcm").write_bytes(b"nope")
    with pytest.raises(BadInputError):
        cache.get(data / "bad.dcm", "L")


def test_prepare_tool_shards_and_reports(tmp_path, load_tool):
    tool = load_tool("prepare_dataset")
    items = [(_mammo_dicom(tmp_path / f"{i}.dcm", "left", i), "L") for i in range(3)]
    (tmp_path / "broken.dcm").write_bytes(b"\0" * 10)
    items = sorted(items + [(str(tmp_path / "broken.dcm"), "L")])
    shards = [tool.shard(items, i, 3) for i in range(3)]
    assert sorted(sum(shards, [])) == items and all(shards)
    report = tool.run(items, tmp_path / "cache", PARAMS, workers=1)
    assert report.num_bad == 1 and report.errors[0]["reason"] == "not_dicom"
    assert report.counts["cached"] == 3
