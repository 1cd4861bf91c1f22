#!/usr/bin/env python
"""Exam inference of the multi-view detector vs a single-view Faster R-CNN (target: <= 1.15x).

One screening exam = 4 images (L-CC, L-MLO, R-CC, R-MLO); each is the main view once, its
ipsilateral other view the auxiliary (pairs CC<->MLO per breast). Compared, in eval mode under
no_grad, on the same 4 random images at the same canonical size:

* multi-view ``MultiViewRCNN.inference_exam(images, pairs)``: each image encoded once, LCM fusion
  per pair, FPN + RPN + ROI heads on the 4 mains;
* single-view: the same config with MODEL.BRAIXDET.MULTI_VIEW False (same backbone),
  ``model.inference`` on the 4 images in one batch (the reference);
* for context, the naive multi-view path without feature sharing: ``model.inference`` on the 4
  (main, aux) inputs in one batch (8 encoder passes), and ``model([input])`` once per image.

Random init; paper model (configs/BRAIxDet/braixdet.yaml: FPN/LCM 128, RPN top-k 1000) at a
reduced size by default. Variants alternate after a warm-up; medians over repeats.

    .venv/bin/python benchmarks/benchmark_exam_inference.py [--size 512 256] [--repeats 5]
        [--config BRAIxDet/braixdet.yaml] [--no-naive] [--out table.md] [--profile]
"""
import argparse
import cProfile
import pstats
import tempfile

import _common as C
import torch
from detectron2.modeling import build_model

PAIRS = [(0, 1), (1, 0), (2, 3), (3, 2)]  # L-CC<->L-MLO, R-CC<->R-MLO
VIEWS = ["L-CC", "L-MLO", "R-CC", "R-MLO"]


def build(config, size, multi_view, tmp, extra):
    opts = C.size_opts(size) + ["MODEL.BRAIXDET.MULTI_VIEW", str(bool(multi_view)),
                                "MODEL.DEVICE", "cpu"] + list(extra)
    cfg = C.build_cfg(config, opts, output_dir=tmp)
    torch.manual_seed(0)  # same init of the shared parts in both models
    return build_model(cfg).eval(), cfg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="BRAIxDet/braixdet.yaml", help="relative to configs/")
    ap.add_argument("--size", type=int, nargs=2, default=[512, 256], metavar=("H", "W"),
                    help="canonical size (paper: 1536 768)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="the defaults (sized for 2 CPU cores)")
    ap.add_argument("--no-naive", action="store_true", help="skip the naive multi-view paths")
    ap.add_argument("--target", type=float, default=1.15)
    ap.add_argument("--profile", action="store_true", help="cProfile one call of each (top 20)")
    ap.add_argument("--opts", nargs=argparse.REMAINDER, default=[], help="extra config opts")
    ap.add_argument("--out", default=None, help="also write the markdown report here")
    args = ap.parse_args()
    C.set_threads()
    size = tuple(args.size)

    with tempfile.TemporaryDirectory(prefix="braixdet_bench_exam_") as tmp:
        mv, cfg = build(args.config, size, True, tmp, args.opts)
        sv, _ = build(args.config, size, False, tmp, args.opts)
        g = torch.Generator().manual_seed(0)
        images = [torch.rand(1, *size, generator=g) for _ in VIEWS]
        hw = [size] * 4
        mv_inputs = [{"image": images[m], "aux_image": images[a], "height": size[0],
                      "width": size[1]} for m, a in PAIRS]
        sv_inputs = [{"image": im, "height": size[0], "width": size[1]} for im in images]

        fns = {
            "single": lambda: sv.inference(sv_inputs),
            "exam": lambda: mv.inference_exam(images, PAIRS, sizes=hw),
        }
        if not args.no_naive:
            fns["naive_batch"] = lambda: mv.inference(mv_inputs)
            fns["naive_loop"] = lambda: [mv([x]) for x in mv_inputs]

        def run():
            with torch.no_grad():
                return C.interleaved(fns, args.repeats, args.warmup)

        times = run()
        if args.profile:
            for name in ("single", "exam"):
                prof = cProfile.Profile()
                with torch.no_grad():
                    prof.enable()
                    fns[name]()
                    prof.disable()
                print(f"### cProfile: {name}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        n_det = [len(r["instances"]) for r in fns["exam"]()]

    ref = C.median(times["single"])
    labels = {
        "single": "single-view Faster R-CNN, `inference` on 4 images (reference)",
        "exam": "multi-view `inference_exam` (4 encodes, 4 LCM fusions)",
        "naive_batch": "multi-view `inference` on 4 (main, aux) inputs (8 encodes), context",
        "naive_loop": "multi-view `model([x])` x 4 (8 encodes), context",
    }
    rows = []
    for n, t in times.items():
        pr = C.median(C.paired_ratios(times, n, "single"))
        rows.append([labels[n], C.ms(C.median(t)), C.ms(min(t)),
                     "{} – {}".format(*map(C.ms, C.iqr(t))),
                     f"{pr:.2f} (medians {C.median(t) / ref:.2f}, mins "
                     f"{min(t) / min(times['single']):.2f})"])
    ratio = C.median(C.paired_ratios(times, "exam", "single"))
    text = (
        f"config `{args.config}` ({cfg.MODEL.BRAIXDET.TIMM_MODEL}, FPN "
        f"{cfg.MODEL.FPN.OUT_CHANNELS}, LCM {cfg.MODEL.BRAIXDET.LCM.EMBED_DIM}/"
        f"{cfg.MODEL.BRAIXDET.LCM.OUT_DIM}, RPN test top-k {cfg.MODEL.RPN.PRE_NMS_TOPK_TEST}/"
        f"{cfg.MODEL.RPN.POST_NMS_TOPK_TEST}), canonical size {size[0]}x{size[1]}, one exam of "
        f"4 images, eval + no_grad, {args.repeats} interleaved repeats after {args.warmup} "
        f"warm-up rounds; detections per image (exam path): {n_det}\n\n"
        + C.md_table(["variant", "median ms", "min ms", "IQR ms",
                      "x single-view (median of paired per-round ratios)"], rows)
        + f"\n\ninference_exam / single-view = **{ratio:.2f}** (target <= {args.target}): "
        + C.verdict(ratio, args.target)
    )
    C.emit("Exam inference: multi-view vs single-view", text, args.out)


if __name__ == "__main__":
    main()
