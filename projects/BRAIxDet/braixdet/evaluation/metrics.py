"""Pure-numpy detection metrics for one class: COCO-style AP and FROC (docs/DESIGN.md §5).

Inputs everywhere:
  gts:  {image_id: (N, 4) array of XYXY boxes}          (N may be 0: a lesion-free image)
  dets: {image_id: ((M, 4) XYXY boxes, (M,) scores)}    (M may be 0)
The evaluated images are the union of both dicts' keys; an image only in `dets` has no GT.

Box conventions (shared by AP and FROC):
  * IoU is pycocotools' bbox IoU: boxes become (x, y, w, h) with w = x1 - x0, area = w * h,
    no "+1" pixel convention, IoU = inter / (area_d + area_g - inter).
  * A box with w == 0 or h == 0 is degenerate: it has IoU 0 with everything, so a degenerate
    detection is always a false positive and a degenerate GT is always missed (as in
    pycocotools). Inverted boxes (x1 < x0 or y1 < y0) are rejected with ValueError: pycocotools
    would silently ignore them through its area range, which hides bugs.
  * pycocotools' area range "all" is [0, 1e10] px^2; nothing larger than 1e5 x 1e5 px exists in
    mammography, so no box is ever excluded by area here.
  * Boxes are used as given: nothing is clipped to the image (the metrics don't know its size).
    A detection outside the image cannot overlap a GT inside it and is a false positive.
"""
import warnings
from dataclasses import dataclass

import numpy as np

__all__ = ["average_precision", "froc", "match_detections", "MatchResult", "box_iou_coco"]

# pycocotools' recall thresholds for the 101-point interpolation
REC_THRS = np.linspace(0.0, 1.0, int(np.round((1.00 - 0.0) / 0.01)) + 1, endpoint=True)


@dataclass
class MatchResult:
    """Per-detection outcome of greedy matching. Arrays cover the kept detections (top
    `max_dets` of each image) in input order, images concatenated in `image_ids` order."""

    image_ids: list  # evaluated images, in evaluation order
    scores: np.ndarray  # (K,) float64
    is_tp: np.ndarray  # (K,) bool
    image_index: np.ndarray  # (K,) int, index into image_ids
    order: np.ndarray  # (K,) indices sorting by descending score exactly as COCOeval.accumulate
    num_gt: int  # number of GT boxes over all evaluated images


def _iou_elementwise(d, g):
    """pycocotools' C `bbIou` on XYXY boxes d (..., 4), g (..., 4) (broadcast), converted to
    XYWH first so the float operations are the same as on a COCO json."""
    dx, dy, dw, dh = d[..., 0], d[..., 1], d[..., 2] - d[..., 0], d[..., 3] - d[..., 1]
    gx, gy, gw, gh = g[..., 0], g[..., 1], g[..., 2] - g[..., 0], g[..., 3] - g[..., 1]
    w = np.minimum(dw + dx, gw + gx) - np.maximum(dx, gx)
    h = np.minimum(dh + dy, gh + gy) - np.maximum(dy, gy)
    inter = w * h
    ok = (w > 0) & (h > 0)
    union = np.where(ok, dw * dh + gw * gh - inter, 1.0)
    return np.where(ok, inter / union, 0.0)


def box_iou_coco(d, g):
    """IoU between XYXY boxes d (..., D, 4) and g (..., G, 4) -> (..., D, G), as pycocotools."""
    d = np.asarray(d, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    return _iou_elementwise(d[..., :, None, :], g[..., None, :, :])


def _center_inside(d, g):
    """Detection centre inside the GT box (borders included); degenerate detections never."""
    cx = (d[..., 0] + d[..., 2]) / 2
    cy = (d[..., 1] + d[..., 3]) / 2
    return ((cx >= g[..., 0]) & (cx <= g[..., 2]) & (cy >= g[..., 1]) & (cy <= g[..., 3])
            & (d[..., 2] > d[..., 0]) & (d[..., 3] > d[..., 1]))


def _stack_boxes(arrays, what):
    """Concatenate per-image box arrays into (K, 4) float64, validated once."""
    arrays = [a.reshape(0, 4) if a.size == 0 else a for a in arrays]
    for a in arrays:
        if a.ndim != 2 or a.shape[1] != 4:
            raise ValueError(f"{what}: expected (N, 4) arrays of XYXY boxes, got shape {a.shape}")
    b = np.concatenate(arrays) if arrays else np.zeros((0, 4))
    if not np.isfinite(b).all():
        raise ValueError(f"{what}: boxes contain NaN or inf")
    if (b[:, 2] < b[:, 0]).any() or (b[:, 3] < b[:, 1]).any():
        raise ValueError(f"{what}: inverted boxes (x1 < x0 or y1 < y0); expected XYXY")
    return b


def _stable_argsort_desc(scores):
    """np.argsort(-scores, kind="stable"), faster: the unstable sort is exact without ties."""
    order = np.argsort(-scores)
    s = scores[order]
    if len(s) > 1 and (s[1:] == s[:-1]).any():
        order = np.argsort(-scores, kind="stable")
    return order


def _image_order(gts, dets):
    keys = list(dict.fromkeys(list(gts.keys()) + list(dets.keys())))
    try:  # COCOeval evaluates images by sorted id; ties in score across images follow it
        return sorted(keys)
    except TypeError:
        return keys


def match_detections(gts, dets, iou_thresh=0.2, max_dets=100, center_hit=False):
    """Greedy matching of every image's detections to its GT boxes, vectorised over images.

    Per image, the top `max_dets` detections by score (stable sort, as COCOeval's mergesort; None
    = keep all) are visited by descending score; each takes the unmatched GT with the highest IoU
    among the eligible ones, ties going to the later GT (COCOeval's rule). Eligible: IoU >=
    iou_thresh, or with `center_hit` the detection's centre lies inside the GT box (borders
    included; degenerate detections are never eligible). Unmatched detections are FPs, so
    duplicates on one lesion give 1 TP + FPs.
    """
    if not 0.0 < iou_thresh <= 1.0:
        raise ValueError(f"iou_thresh must be in (0, 1], got {iou_thresh}")
    thr = min(iou_thresh, 1 - 1e-10)  # COCOeval's cap
    image_ids = _image_order(gts, dets)
    n_img = len(image_ids)

    gt_arrays = [np.asarray(gts.get(i, ()), dtype=np.float64) for i in image_ids]
    gt_all = _stack_boxes(gt_arrays, "gts")
    n_gt_img = np.array([len(a) if a.size else 0 for a in gt_arrays], dtype=np.int64)
    gt_start = np.cumsum(n_gt_img) - n_gt_img

    box_list, score_list, n_det_img = [], [], np.zeros(n_img, dtype=np.int64)
    for k, i in enumerate(image_ids):
        if i in dets:
            b, s = dets[i]
            b = np.asarray(b, dtype=np.float64)
            s = np.asarray(s, dtype=np.float64).reshape(-1)
            if (len(b) if b.size else 0) != len(s):
                raise ValueError(f"dets[{i!r}]: {len(b)} boxes but {len(s)} scores")
            box_list.append(b)
            score_list.append(s)
            n_det_img[k] = len(s)
    boxes = _stack_boxes(box_list, "dets")
    scores = np.concatenate(score_list) if score_list else np.zeros(0)
    if not np.isfinite(scores).all():
        raise ValueError("dets: scores contain NaN or inf")
    img_of = np.repeat(np.arange(n_img), n_det_img)
    n_det = len(scores)

    # Global order by descending score, ties by (image order, input order): both COCOeval's
    # per-image mergesort and its global mergesort over the concatenation reduce to this.
    order = _stable_argsort_desc(scores)
    gpos = np.empty(n_det, dtype=np.int64)  # position in the global order
    gpos[order] = np.arange(n_det)
    if max_dets is None or n_det == 0 or n_det_img.max() <= max_dets:
        keep = np.ones(n_det, dtype=bool)
    else:  # rank within the image (stable sort of the image index: radix sort for uint16)
        img_o = img_of[order]
        p = np.argsort(img_o.astype(np.uint16 if n_img < 2**16 else np.int64), kind="stable")
        det_start = np.cumsum(n_det_img) - n_det_img
        rank = np.empty(n_det, dtype=np.int64)
        rank[order[p]] = np.arange(n_det) - det_start[img_o[p]]
        keep = rank < max_dets

    # eligible (detection, GT) pairs within each image
    kd = np.flatnonzero(keep & (n_gt_img[img_of] > 0))
    ng = n_gt_img[img_of[kd]]
    pair_det = np.repeat(kd, ng)
    pair_gt = np.repeat(gt_start[img_of[kd]] - (np.cumsum(ng) - ng), ng) + np.arange(ng.sum())
    # cheap pre-filter on x-overlap (same float operations as the IoU), then the exact IoU
    dT, gT = boxes.T.copy(), gt_all.T.copy()  # column-major: contiguous per-coordinate gathers
    dx0, gx0 = dT[0][pair_det], gT[0][pair_gt]
    w = np.minimum((dT[2] - dT[0])[pair_det] + dx0, (gT[2] - gT[0])[pair_gt] + gx0)
    w -= np.maximum(dx0, gx0)
    ok = w > 0
    pair_det, pair_gt = pair_det[ok], pair_gt[ok]
    pair_iou = _iou_elementwise(dT[:, pair_det].T, gT[:, pair_gt].T)
    if center_hit:
        ok = _center_inside(dT[:, pair_det].T, gT[:, pair_gt].T)
    else:
        ok = pair_iou >= thr
    pair_det, pair_gt, pair_iou = pair_det[ok], pair_gt[ok], pair_iou[ok]

    is_tp = np.zeros(n_det, dtype=bool)
    # Images where no detection has two eligible GTs: each GT goes to its first (highest
    # ranked) eligible detection, no sequential loop needed. The rest use the exact greedy loop.
    multi = np.bincount(pair_det, minlength=n_det) >= 2
    hard_img = np.zeros(n_img, dtype=bool)
    hard_img[img_of[multi]] = True
    easy = ~hard_img[img_of[pair_det]]
    e_det, e_gt = pair_det[easy], pair_gt[easy]
    if len(e_det):
        first = np.full(len(gt_all), n_det, dtype=np.int64)
        np.minimum.at(first, e_gt, gpos[e_det])
        is_tp[e_det[gpos[e_det] == first[e_gt]]] = True
    # within an image, the global position orders detections like their score rank
    _greedy_hard(np.flatnonzero(hard_img), pair_det[~easy], pair_gt[~easy], pair_iou[~easy],
                 img_of, gpos, gt_start, n_gt_img, is_tp)
    if keep.all():
        return MatchResult(image_ids, scores, is_tp, img_of, order, int(n_gt_img.sum()))
    keep_idx = np.flatnonzero(keep)
    out_order = order[keep[order]]
    # re-index to kept detections
    new_index = np.full(n_det, -1, dtype=np.int64)
    new_index[keep_idx] = np.arange(len(keep_idx))
    return MatchResult(image_ids, scores[keep_idx], is_tp[keep_idx], img_of[keep_idx],
                       new_index[out_order], int(n_gt_img.sum()))


def _greedy_hard(images, pd, pg, piou, img_of, rank, gt_start, n_gt_img, is_tp):
    """Exact sequential greedy matching (COCOeval's loop) on the eligible pairs (pd, pg, piou)
    of `images`; `rank` orders an image's detections by descending score. Images with the same
    number of GTs share padded arrays; the loop runs over detection ranks, each step vectorised
    over the images."""
    if len(images) == 0:
        return
    hd = np.unique(pd)
    hd = hd[np.lexsort((rank[hd], img_of[hd]))]  # by image, then by score rank
    him = img_of[hd]
    cnt = np.bincount(him, minlength=len(n_gt_img))
    lr = np.arange(len(hd)) - (np.cumsum(cnt) - cnt)[him]  # rank among eligible detections
    pos = np.full(len(is_tp), -1, dtype=np.int64)
    pos[hd] = np.arange(len(hd))
    pim = img_of[pd]
    for g in np.unique(n_gt_img[images]):
        imgs = images[n_gt_img[images] == g]
        local = np.full(len(n_gt_img), -1, dtype=np.int64)
        local[imgs] = np.arange(len(imgs))
        dsel = local[him] >= 0
        psel = local[pim] >= 0
        n_d = int(lr[dsel].max()) + 1
        val = np.full((len(imgs), n_d, g), -np.inf)
        val[local[pim[psel]], lr[pos[pd[psel]]], pg[psel] - gt_start[pim[psel]]] = piou[psel]
        matched = np.zeros((len(imgs), g), dtype=bool)
        tp_pad = np.zeros((len(imgs), n_d), dtype=bool)
        rows = np.arange(len(imgs))
        for k in range(n_d):
            cand = np.where(matched, -np.inf, val[:, k])
            j = g - 1 - np.argmax(cand[:, ::-1], axis=1)  # highest IoU, ties -> last GT
            hit = np.isfinite(cand[rows, j])
            matched[rows[hit], j[hit]] = True
            tp_pad[:, k] = hit
        is_tp[hd[dsel]] = tp_pad[local[him[dsel]], lr[dsel]]


def average_precision(gts, dets, iou_thresh=0.2, max_dets=100):
    """COCO-style AP (101-point interpolation) of one class at one IoU threshold, in [0, 1].

    Equals pycocotools COCOeval (iouType "bbox", params.iouThrs=[iou_thresh], areaRng "all" =
    [0, 1e10] i.e. no box excluded by size, maxDets=[max_dets], useCats=1, no crowd boxes):
    each image keeps its `max_dets` highest-scoring detections; greedy matching as in
    `match_detections`; the precision envelope is sampled at recall np.linspace(0, 1, 101) with
    searchsorted(side="left"), points beyond the reached recall counting 0.

    Returns NaN (with a RuntimeWarning) when the evaluated images contain no GT box at all, and
    0 when there is GT but no detection.
    """
    m = match_detections(gts, dets, iou_thresh, max_dets)
    if m.num_gt == 0:
        warnings.warn("average_precision: no ground-truth box in any image; AP is NaN",
                      RuntimeWarning, stacklevel=2)
        return float("nan")
    tps = m.is_tp[m.order]
    tp = np.cumsum(tps).astype(float)
    fp = np.cumsum(~tps).astype(float)
    if len(tp) == 0:
        return 0.0
    rc = tp / m.num_gt
    pr = tp / (fp + tp + np.spacing(1))
    pr = np.maximum.accumulate(pr[::-1])[::-1]  # precision envelope
    idx = np.searchsorted(rc, REC_THRS, side="left")
    q = np.where(idx < len(pr), pr[np.minimum(idx, len(pr) - 1)], 0.0)
    return float(np.mean(q))


def froc(gts, dets, iou_thresh=0.2, center_hit=False, fppi_points=(0.25, 0.5, 1, 2, 4),
         max_dets=None):
    """Free-response ROC: lesion sensitivity vs false positives per image (FPPI).

    A detection is a TP when it matches a not-yet-matched GT (IoU >= iou_thresh, or its centre
    inside the GT box with `center_hit`), greedily per image by descending score; duplicates on
    one lesion count 1 TP + FPs. FPPI = #FP / number of ALL evaluated images (lesion-free images
    included). `max_dets` (None = all) caps detections per image as in AP.

    Returns a dict:
      fppi, sensitivity, thresholds: curve arrays, one point per distinct score (detections with
        score >= threshold kept), preceded by the empty operating point (inf, 0, 0);
      recall_at_fppi: {x: max sensitivity over points with fppi <= x} for x in fppi_points
        (0 when none; NaN with a warning when there is no GT box at all);
      num_images, num_lesions, num_detections.
    """
    m = match_detections(gts, dets, iou_thresh, max_dets, center_hit=center_hit)
    n_img = len(m.image_ids)
    s = m.scores[m.order]
    tps = m.is_tp[m.order]
    ctp = np.cumsum(tps)
    cfp = np.cumsum(~tps)
    last = np.r_[s[1:] != s[:-1], True] if len(s) else np.zeros(0, dtype=bool)
    thresholds = np.r_[np.inf, s[last]]
    tp_at = np.r_[0, ctp[last]]
    fp_at = np.r_[0, cfp[last]]
    fppi = fp_at / max(n_img, 1)
    if m.num_gt == 0:
        warnings.warn("froc: no ground-truth box in any image; sensitivity is NaN",
                      RuntimeWarning, stacklevel=2)
        sens = np.full(len(tp_at), np.nan)
    else:
        sens = tp_at / m.num_gt
    recall_at = {}
    for x in fppi_points:
        ok = fppi <= x
        recall_at[x] = float(np.max(sens[ok])) if ok.any() else 0.0
    return {
        "fppi": fppi,
        "sensitivity": sens,
        "thresholds": thresholds,
        "tp": tp_at,
        "fp": fp_at,
        "recall_at_fppi": recall_at,
        "num_images": n_img,
        "num_lesions": m.num_gt,
        "num_detections": len(s),
    }
