"""Speed of braixdet's numpy AP vs pycocotools COCOeval (evaluate + accumulate), same answer.

    python benchmarks/benchmark_evaluator.py [--images 5000] [--dets 100] [--seed 0]

Random seeded data: each image has 0-3 GT boxes (about a third lesion-free) and `--dets`
detections, half of them jittered copies of its GT boxes. Asserts |AP - AP_coco| <= 1e-6 and
prints a Markdown table with the speed-up (target >= 10x; best of `--repeat` timings each).
Both are numpy / Python on the CPU: ``--device`` is accepted for a uniform command line and only
reported; memory is the process's peak RSS.
"""
import argparse
import contextlib
import io
import time

import _common as C
import numpy as np
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from braixdet.evaluation.metrics import average_precision


def make_data(n_images, n_dets, seed, size=(3000, 2000)):
    rng = np.random.default_rng(seed)
    H, W = size
    gts, dets = {}, {}
    for i in range(1, n_images + 1):
        ng = int(rng.choice([0, 1, 1, 2, 3]))
        xy = rng.uniform(0, [W - 400, H - 400], (ng, 2))
        gts[i] = np.c_[xy, xy + rng.uniform(20, 400, (ng, 2))]
        xy = rng.uniform(0, [W - 400, H - 400], (n_dets, 2))
        b = np.c_[xy, xy + rng.uniform(20, 400, (n_dets, 2))]
        if ng:
            k = rng.integers(0, ng, n_dets // 2)
            j = gts[i][k] + rng.normal(0, 30, (len(k), 4))
            j[:, 2:] = np.maximum(j[:, 2:], j[:, :2] + 1)
            b[: n_dets // 2] = j
        dets[i] = (b, rng.random(n_dets))
    return gts, dets


def to_coco(gts, dets):
    images = sorted(set(gts) | set(dets))
    anns = []
    for i in images:
        for b in gts.get(i, ()):
            w, h = b[2] - b[0], b[3] - b[1]
            anns.append({"id": len(anns) + 1, "image_id": i, "category_id": 1,
                         "bbox": [b[0], b[1], w, h], "area": w * h, "iscrowd": 0})
    gt = {"images": [{"id": i} for i in images], "annotations": anns,
          "categories": [{"id": 1, "name": "malignant"}]}
    res = [{"image_id": i, "category_id": 1, "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
            "score": float(s)} for i, (bb, ss) in dets.items() for b, s in zip(bb, ss)]
    return gt, res


def coco_ap(gt_dict, res, iou_thresh=0.2, max_dets=100):
    """AP from COCOeval; returns (ap, seconds spent in evaluate + accumulate)."""
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = gt_dict
        gt.createIndex()
        dt = gt.loadRes(res)
        ev = COCOeval(gt, dt, "bbox")
        ev.params.iouThrs = np.array([iou_thresh])
        ev.params.maxDets = [max_dets]
        ev.params.areaRng = [[0, 1e5**2]]
        ev.params.areaRngLbl = ["all"]
        t0 = time.perf_counter()
        ev.evaluate()
        ev.accumulate()
        dt_s = time.perf_counter() - t0
    p = ev.eval["precision"][0, :, 0, 0, 0]
    return (float(np.mean(p[p > -1])) if (p > -1).any() else float("nan")), dt_s


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=5000)
    ap.add_argument("--dets", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings for both")
    ap.add_argument("--min-speedup", type=float, default=10.0)
    C.add_device_args(ap, amp=False)
    args = ap.parse_args(argv)

    gts, dets = make_data(args.images, args.dets, args.seed)
    gt_dict, res = to_coco(gts, dets)
    t_coco = t_ours = float("inf")
    for _ in range(args.repeat):  # best of N: the machine may be shared
        ap_coco, t = coco_ap(gt_dict, res)
        t_coco = min(t_coco, t)
        t0 = time.perf_counter()
        ap_ours = average_precision(gts, dets, iou_thresh=0.2, max_dets=100)
        t_ours = min(t_ours, time.perf_counter() - t0)

    assert abs(ap_ours - ap_coco) <= 1e-6, (ap_ours, ap_coco)
    speedup = t_coco / t_ours
    print(f"\nAP@0.2, {args.images} images x {args.dets} detections (seed {args.seed}), "
          f"best of {args.repeat}\n")
    print("| implementation | AP20 | seconds | speed-up |")
    print("|---|---|---|---|")
    print(f"| pycocotools COCOeval (evaluate+accumulate) | {ap_coco:.6f} | {t_coco:.3f} | 1.0x |")
    print(f"| braixdet.evaluation.metrics | {ap_ours:.6f} | {t_ours:.3f} | {speedup:.1f}x |")
    print(f"\n{args.device} requested; the evaluation runs on the CPU. Process peak RSS "
          f"(getrusage) {C.process_peak_rss_gib():.2f} GiB")
    if speedup < args.min_speedup:
        print(f"WARNING: speed-up {speedup:.1f}x below the {args.min_speedup:g}x target")
    return speedup


if __name__ == "__main__":
    main()
