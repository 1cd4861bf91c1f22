"""The boxes Algorithm 2 fuses with the teacher's (SSL.CAM_BOX_SOURCE), and D_w's truth.

Sources (docs/DESIGN.md, "Oracle box sources"):
* ``gradcam`` (the paper): Algorithm 1's boxes, read from SSL.CAM_JSON (cam.py).
* ``oracle``: D_w's true cancer boxes, the upper bound of what any Algorithm 1 could give.
* ``random``: boxes at random places inside the breast, their count and sizes drawn from the true
  boxes of D_w (pooled, in the canonical frame): the lower bound, boxes that know nothing about
  the image beyond its breast outline. Seeded; an image's boxes depend on the seed and its id only.

Every lookup has the GradCAM file's format: image_id -> {"boxes": [[x0, y0, x1, y1]] in original
pixels, "scores": [...]}, so Algorithm 2 and the mapping into the training frame
(``cam_boxes_in_input_frame``) are the same code for every source. Oracle and random boxes score
1.0 (our choice: an oracle box is never suppressed by an overlapping teacher box, and the two
bounds differ in where the boxes are, nothing else).

The truth is the boxes the protocol withheld from D_w (``withheld_annotations``, see
data/protocols.py); images that were weak in the source data have none and get no oracle box.
It is read by ``true_box_lookup`` only, which ``source_lookup`` calls for the oracle and random
sources and the trainer calls for the quality scalars (pseudo_quality.py), never for "gradcam".
"""
import hashlib
import logging
from typing import Dict

import cv2
import numpy as np

from ..cam import known_lesions, load_cam_boxes
from ..data.report import BadInputError

logger = logging.getLogger(__name__)

__all__ = ["CAM_BOX_SOURCES", "true_box_lookup", "breast_region", "place_random_boxes",
           "random_box_lookup", "source_lookup"]

CAM_BOX_SOURCES = ("gradcam", "oracle", "random")
_SHRINK, _MAX_SHRINKS = 0.8, 20  # a drawn box larger than the breast shrinks until it fits


def true_box_lookup(weak_dicts) -> Dict[str, dict]:
    """image_id -> {"boxes": true cancer boxes (original px), "scores": 1.0 each} for the weak
    label-1 images whose boxes the protocol withheld; others are absent (truth unknown)."""
    out = {}
    for d in weak_dicts:
        boxes = known_lesions(d)
        if int(d["label"]) == 1 and len(boxes):
            out[str(d["image_id"])] = {"boxes": boxes.tolist(), "scores": [1.0] * len(boxes)}
    return out


def breast_region(canonical: np.ndarray) -> np.ndarray:
    """bool (H, W): the breast in a canonical image. Canonicalisation zeroes every pixel outside
    the breast mask (data/preprocess.py); the largest non-zero component, holes filled, is it."""
    nonzero = (np.asarray(canonical) > 0).astype(np.uint8)
    n, labels, stats, _ = cv2.connectedComponentsWithStats(nonzero, connectivity=8)
    if n <= 1:
        return np.zeros(nonzero.shape, bool)
    comp = (labels == 1 + int(np.argmax(stats[1:, cv2.CC_STAT_AREA]))).astype(np.uint8)
    contours, _ = cv2.findContours(comp, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    filled = np.zeros_like(comp)
    cv2.drawContours(filled, contours, -1, 1, thickness=cv2.FILLED)
    return filled.astype(bool)


def _fitting_corners(region, h, w):
    """(ys, xs) of the top-left corners where an h x w box lies wholly inside ``region``."""
    H, W = region.shape
    if h > H or w > W:
        return np.zeros(0, int), np.zeros(0, int)
    ii = np.pad(region.astype(np.int64).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    inside = ii[h:, w:] - ii[:H - h + 1, w:] - ii[h:, :W - w + 1] + ii[:H - h + 1, :W - w + 1]
    return np.nonzero(inside == h * w)


def place_random_boxes(region, sizes, rng) -> np.ndarray:
    """(k, 4) XYXY integer boxes, one per (w, h) in ``sizes``, each wholly inside ``region`` at a
    uniformly drawn position (shrunk by 0.8 until it fits; dropped if nothing fits)."""
    out = []
    for w, h in sizes:
        for _ in range(_MAX_SHRINKS):
            wi, hi = max(1, int(round(w))), max(1, int(round(h)))
            ys, xs = _fitting_corners(region, hi, wi)
            if len(ys):
                j = int(rng.integers(len(ys)))
                out.append([xs[j], ys[j], xs[j] + wi, ys[j] + hi])
                break
            w, h = w * _SHRINK, h * _SHRINK
    return np.asarray(out, np.float64).reshape(-1, 4)


def _image_rng(seed, image_id):
    digest = int(hashlib.sha256(str(image_id).encode()).hexdigest()[:8], 16)
    return np.random.default_rng([int(seed), digest])


def _canonical(cache, d):
    """(canonical image, transform), or None with a one-line warning (the mapper skips the
    image in training too)."""
    try:
        return cache.get(d["file_name"], d.get("laterality"))
    except (BadInputError, ValueError) as e:
        logger.warning("random boxes: skipping %s: %s", d.get("image_id"),
                       str(e).replace("\n", " "))
        return None


def random_box_lookup(weak_dicts, cache, seed) -> Dict[str, dict]:
    """The ``random`` source for every weak label-1 image (see the module docstring).

    ``cache``: the CanonicalCache of the training mapper (canonical pixels and transforms).
    """
    truth = true_box_lookup(weak_dicts)
    if not truth:
        raise ValueError("SSL.CAM_BOX_SOURCE random: no weak cancer of D_w has known boxes to "
                         "draw the count and sizes from")
    cancers = [d for d in weak_dicts if int(d["label"]) == 1]
    counts, sizes = [], []
    for d in cancers:  # pass 1: the true boxes' sizes in the canonical frame
        entry = truth.get(str(d["image_id"]))
        canonical = _canonical(cache, d) if entry else None
        if canonical is not None:
            boxes = canonical[1].apply_box(np.asarray(entry["boxes"], np.float64))
            counts.append(len(boxes))
            sizes += [(x1 - x0, y1 - y0) for x0, y0, x1, y1 in boxes]
    counts, sizes = np.asarray(counts), np.asarray(sizes)
    out = {}
    for d in cancers:  # pass 2, one image in memory at a time
        canonical = _canonical(cache, d)
        if canonical is None:
            continue
        img, tfm = canonical
        rng = _image_rng(seed, d["image_id"])
        n = int(counts[rng.integers(len(counts))])
        drawn = sizes[rng.integers(len(sizes), size=n)]
        boxes = place_random_boxes(breast_region(img), drawn, rng)
        if len(boxes):
            boxes = tfm.inverse().apply_box(boxes)
        out[str(d["image_id"])] = {"boxes": boxes.tolist(), "scores": [1.0] * len(boxes)}
    return out


def source_lookup(cfg, weak_dicts, cache_factory, seed) -> Dict[str, dict]:
    """The lookup Algorithm 2 fuses, per SSL.CAM_BOX_SOURCE ({} when SSL.USE_CAM is off or the
    GradCAM file is not set). ``cache_factory()`` gives the training CanonicalCache and ``seed``
    seeds the random source (the run's training seed)."""
    s = cfg.SSL
    source = s.CAM_BOX_SOURCE
    if source not in CAM_BOX_SOURCES:
        raise ValueError(f"SSL.CAM_BOX_SOURCE must be one of {CAM_BOX_SOURCES}, got {source!r}")
    if source != "gradcam":
        if not s.USE_CAM:
            raise ValueError(f"SSL.CAM_BOX_SOURCE {source} is fused by Algorithm 2 only: set "
                             "SSL.USE_CAM True")
        if s.CAM_JSON or s.CAM_VIEW_AGREEMENT > 0:
            raise ValueError(f"SSL.CAM_JSON and SSL.CAM_VIEW_AGREEMENT apply to GradCAM boxes "
                             f"only: set them to '' and 0 with SSL.CAM_BOX_SOURCE {source}")
    if not s.USE_CAM:
        return {}
    if source == "gradcam":
        return load_cam_boxes(s.CAM_JSON, weak_dicts, s.CAM_VIEW_AGREEMENT) if s.CAM_JSON else {}
    if source == "oracle":
        lookup = true_box_lookup(weak_dicts)
    else:
        lookup = random_box_lookup(weak_dicts, cache_factory(), seed)
    cancers = sum(int(d["label"]) == 1 for d in weak_dicts)
    logger.info("Algorithm 2 fuses %s boxes: %d boxes on %d of D_w's %d cancers", source,
                sum(len(v["boxes"]) for v in lookup.values()),
                sum(bool(v["boxes"]) for v in lookup.values()), cancers)
    return lookup
