"""GradCAM pseudo-labelling cost vs one classifier forward+backward (target: <= 1.2x).

GradCAM (Algorithm 1) needs one forward of the two-view classifier and a backward from the logit
to the main view's fused res5 only (not through the encoder), so it should cost about one forward.
The reference is a forward + backward to all parameters, i.e. a training step without optimiser.

    .venv/bin/python benchmarks/benchmark_gradcam.py [--sizes 256x128 1536x768] [--batch 2]
        [--reps 3] [--device cpu|cuda] [--out table.md]

Random init (the timing does not depend on the weights); paper-size model (config defaults:
efficientnet_b0, LCM d=128, D'=128).
"""
import argparse
import time

import torch
from detectron2.config import get_cfg
from detectron2.modeling import build_model

import braixdet.modeling  # noqa: F401
from braixdet.config import add_braixdet_config
from braixdet.ssl.cam_boxes import gradcam_heatmaps


def _sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn, reps, device):
    fn()  # warm-up (allocator, cudnn/oneDNN algorithm choice)
    _sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - t) / reps


def bench(size, batch, reps, device):
    cfg = get_cfg()
    add_braixdet_config(cfg)
    cfg.MODEL.META_ARCHITECTURE = "MVCCLClassifier"
    cfg.MODEL.DEVICE = device
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    h, w = size
    inputs = [{"image": torch.rand(1, h, w), "aux_image": torch.rand(1, h, w), "label": 1}
              for _ in range(batch)]

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        logits = torch.stack([o["logit"] for o in model(inputs)])
        logits.sum().backward()

    def cam():
        gradcam_heatmaps(model, inputs)

    t_fb = _time(fwd_bwd, reps, device)
    t_cam = _time(cam, reps, device)
    return {"size": f"{h}x{w}", "batch": batch, "cam_ips": batch / t_cam,
            "fb_ips": batch / t_fb, "ratio": t_cam / t_fb}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=["256x128", "1536x768"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    ap.add_argument("--out", default="", help="also write the markdown table here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for s in args.sizes:
        h, w = (int(v) for v in s.lower().split("x"))
        rows.append(bench((h, w), args.batch, args.reps, args.device))
    lines = [
        f"GradCAM pseudo-labelling vs classifier forward+backward ({args.device}, "
        f"torch threads {torch.get_num_threads()}, batch {args.batch}, {args.reps} reps)",
        "",
        "| input (HxW) | batch | GradCAM images/s | fwd+bwd images/s | GradCAM / fwd+bwd time |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ok = "ok" if r["ratio"] <= 1.2 else "ABOVE 1.2x target"
        lines.append(f"| {r['size']} | {r['batch']} | {r['cam_ips']:.2f} | {r['fb_ips']:.2f} | "
                     f"{r['ratio']:.2f}x ({ok}) |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
