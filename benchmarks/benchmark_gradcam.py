#!/usr/bin/env python
"""GradCAM pseudo-labelling cost vs one classifier forward+backward (target: <= 1.2x).

GradCAM (Algorithm 1) needs one forward of the two-view classifier and a backward from the logit
to the main view's fused res5 only (not through the encoder), so it should cost about one forward.
The reference is a forward + backward to all parameters, i.e. a training step without optimiser.

Stage-1 model of configs/MVCCL/mvccl.yaml (efficientnet_b0, LCM d=128, D'=128, GCM) with random
init (MODEL.BRAIXDET.PRETRAINED ""; the timing does not depend on the weights), on ``--device``
with the inputs already there; the two variants alternate after a warm-up, the device
synchronised before every clock reading. ``--amp`` runs both under ``torch.autocast`` (bf16 where
supported, else fp16); ``--compare-amp`` interleaves fp32 and AMP and prints them side by side.

    .venv/bin/python benchmarks/benchmark_gradcam.py [--size 256 128 [--size 1536 768]]
        [--batch 2] [--repeats 3] [--device cpu|cuda] [--amp] [--compare-amp] [--out table.md]

Paper size on a GPU (issue #13 table: GradCAM, batch 8):

    python benchmarks/benchmark_gradcam.py --device cuda --size 1536 768 --batch 8 --compare-amp
"""
import argparse
import tempfile

import _common as C
import torch
from detectron2.modeling import build_model

from braixdet.cam import gradcam_heatmaps


def bench(args, size, precs, tmp):
    cfg = C.build_cfg(args.config,
                      C.size_opts(size) + C.device_opts(args.device) + list(args.opts),
                      output_dir=tmp)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    h, w = size
    g = torch.Generator().manual_seed(0)
    inputs = C.to_device([{"image": torch.rand(1, h, w, generator=g),
                           "aux_image": torch.rand(1, h, w, generator=g), "label": 1}
                          for _ in range(args.batch)], args.device)
    cam_cfg = cfg.MODEL.BRAIXDET.CAM

    def fwd_bwd(amp):
        def fn():
            model.zero_grad(set_to_none=True)
            with C.autocast(amp, args.device):
                logits = torch.stack([o["logit"] for o in model(inputs)])
            logits.float().sum().backward()
        return fn

    def cam(amp):
        def fn():
            with C.autocast(amp, args.device):
                gradcam_heatmaps(model, inputs, method=cam_cfg.METHOD,
                                 target_layer=cam_cfg.TARGET_LAYER)
        return fn

    notes = []
    if True in precs:
        try:  # gradcam_heatmaps returns numpy: a bf16 map cannot be converted
            cam(True)()
        except TypeError as e:
            notes.append(f"GradCAM under {C.precision_name(True, args.device)} fails in "
                         f"`braixdet.cam.gradcam_heatmaps` ({e}): its heatmap is "
                         "returned as numpy without a cast to float32; AMP GradCAM skipped")
    fns = {}
    for amp in precs:
        fns[("fwd_bwd", amp)] = fwd_bwd(amp)
        if not (amp and notes):
            fns[("cam", amp)] = cam(amp)
    times = C.interleaved(fns, args.repeats, args.warmup, args.device)
    peaks = {k: C.measure_peak(f, args.device) for k, f in fns.items()}
    return {"size": size, "times": times, "peaks": peaks, "notes": notes, "cfg": cfg}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="MVCCL/mvccl.yaml", help="relative to configs/")
    ap.add_argument("--size", type=int, nargs=2, action="append", metavar=("H", "W"),
                    help="input size, repeatable (default: 256 128 and 1536 768)")
    ap.add_argument("--sizes", nargs="+", default=None, help="the same as HxW strings")
    ap.add_argument("--batch", type=int, default=2, help="images per call (paper table: 8)")
    ap.add_argument("--repeats", "--reps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="256x128 only")
    ap.add_argument("--target", type=float, default=1.2)
    C.add_device_args(ap)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (0 = $BENCH_THREADS, default 2)")
    args = C.parse_args(ap)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [tuple(s) for s in args.size or []]
    sizes += [tuple(int(v) for v in s.lower().split("x")) for s in args.sizes or []]
    sizes = sizes or ([(256, 128)] if args.quick else [(256, 128), (1536, 768)])
    precs = C.precisions(args)

    with tempfile.TemporaryDirectory(prefix="braixdet_bench_cam_") as tmp:
        results = [bench(args, s, precs, tmp) for s in sizes]

    rows, side, verdicts, notes = [], [], [], []
    for r in results:
        t, p, (h, w) = r["times"], r["peaks"], r["size"]
        notes += r["notes"]
        for amp in precs:
            fb = t[("fwd_bwd", amp)]
            cam = t.get(("cam", amp))
            if cam is None:
                continue
            ratio = C.median(C.paired_ratios(t, ("cam", amp), ("fwd_bwd", amp)))
            rows.append([f"{h}x{w}", args.batch, C.precision_name(amp, args.device),
                         f"{args.batch / C.median(cam):.2f}", f"{args.batch / C.median(fb):.2f}",
                         C.ms(C.median(cam)), C.ms(C.median(fb)), C.gib(p[("cam", amp)]),
                         C.gib(p[("fwd_bwd", amp)]),
                         f"{ratio:.2f}x ({'ok' if ratio <= args.target else 'ABOVE target'})"])
            verdicts.append(f"{h}x{w} {C.precision_name(amp, args.device)}: GradCAM / fwd+bwd = "
                            f"**{ratio:.2f}** (target <= {args.target}): "
                            f"{C.verdict(ratio, args.target)}")
        if len(precs) == 2:
            for name, label in (("cam", "GradCAM"), ("fwd_bwd", "forward+backward")):
                if (name, True) not in t:
                    continue
                a, b = C.median(t[(name, False)]), C.median(t[(name, True)])
                ra = C.median(C.paired_ratios(t, (name, False), (name, True)))
                side.append([f"{h}x{w}", label, C.ms(a), C.ms(b), f"{ra:.2f}x",
                             C.gib(p[(name, False)]), C.gib(p[(name, True)])])
    cfg = results[0]["cfg"]
    text = (
        f"config `{args.config}` ({cfg.MODEL.BRAIXDET.TIMM_MODEL}, LCM "
        f"{cfg.MODEL.BRAIXDET.LCM.EMBED_DIM}/{cfg.MODEL.BRAIXDET.LCM.OUT_DIM}, CAM "
        f"{cfg.MODEL.BRAIXDET.CAM.METHOD} at {cfg.MODEL.BRAIXDET.CAM.TARGET_LAYER}), random init, "
        f"batch {args.batch}, {args.repeats} interleaved repeats after {args.warmup} warm-up "
        "rounds\n\n"
        + C.md_table(["input (HxW)", "batch", "precision", "GradCAM images/s",
                      "fwd+bwd images/s", "GradCAM ms/batch", "fwd+bwd ms/batch",
                      "GradCAM peak GiB", "fwd+bwd peak GiB",
                      "GradCAM / fwd+bwd time (paired)"], rows)
        + f"\n\n{C.memory_note(args.device)}\n\n" + "\n".join(verdicts)
    )
    if side:
        text += ("\n\n### fp32 vs " + C.precision_name(True, args.device) + " (interleaved)\n\n"
                 + C.md_table(["input", "variant", "fp32 ms/batch", "AMP ms/batch",
                               "speed-up fp32/AMP (paired)", "fp32 peak GiB", "AMP peak GiB"],
                              side))
    if notes:
        text += "\n\n" + "\n".join(f"NOTE: {n}" for n in notes)
    C.emit("GradCAM pseudo-labelling vs classifier forward+backward", text, args)


if __name__ == "__main__":
    main()
