#!/usr/bin/env python
"""Does the LCM's cross-view path get a gradient with a steady direction? Retrain one stage and
record it.

  python benchmarks/experiment_lcm_grad.py \
      --config out/mv_cost/full/s0/faster_rcnn_mv_sv_init/config.yaml --out out/lcm_grad

docs/RESULTS.md §25. Retrains the stage of a saved config.yaml (in --out, nothing of the
original run is touched) with a hook that reads every step's gradient of the LCM's weights (the
fuse conv's cross-view and own parts, the q/k/v and output projections) and, for comparison,
of layers that do learn (the FPN's res5 and res4 laterals, the box classifier). Per weight:
``drift``, mean over elements of |Σ_t g| / sqrt(T Σ_t g²): Adam moves an element by about
lr·T·drift, and a gradient without a steady direction gives about sqrt(2/(πT)), the
``noise floor``; the gradient's RMS; and how far the weight moved (||w_T − w_0|| / ||w_0||).
Writes <out>/lcm_grad.md and lcm_grad.json. Not part of `make bench`.
"""
import argparse
import math
import os

import torch
from detectron2.engine import HookBase
from detectron2.utils.logger import setup_logger

from braixdet.config import build_cfg, resolve_cfg
from braixdet.engine import trainer_class
from braixdet.modeling.lcm import CrossViewAttention, fuse_weight_slices
from braixdet.utils.io import atomic_write_json, atomic_write_text


def tracked_weights(model):
    """{name: (parameter, slice of its channel-in axis or None)} of the weights to follow."""
    out = {}
    for prefix, mod in model.named_modules():
        if isinstance(mod, CrossViewAttention):
            own, cross = fuse_weight_slices(mod.fuse.weight)
            out[f"{prefix}.fuse, cross-view part"] = (mod.fuse.weight, cross)
            out[f"{prefix}.fuse, own part"] = (mod.fuse.weight, own)
            for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
                out[f"{prefix}.{name}"] = (getattr(mod, name).weight, None)
    params = dict(model.named_parameters())
    for name in ("backbone.fpn_lateral5.weight", "backbone.fpn_lateral4.weight",
                 "roi_heads.box_predictor.cls_score.weight"):
        if name in params:
            out[name] = (params[name], None)
    return out


class GradientRecorder(HookBase):
    """Sums each tracked weight's gradient and squared gradient after every step (the gradient
    stays on the parameters until the next step's zero_grad)."""

    def __init__(self, weights):
        self.weights = weights
        self.sum = {k: None for k in weights}
        self.sum_sq = {k: None for k in weights}
        self.start = {k: self._part(p, s).detach().clone() for k, (p, s) in weights.items()}
        self.steps = 0

    @staticmethod
    def _part(t, cols):
        return t if cols is None else t[:, cols]

    def after_step(self):
        self.steps += 1
        for k, (p, cols) in self.weights.items():
            if p.grad is None:
                continue
            g = self._part(p.grad, cols).detach().double()
            self.sum[k] = g.clone() if self.sum[k] is None else self.sum[k] + g
            self.sum_sq[k] = g * g if self.sum_sq[k] is None else self.sum_sq[k] + g * g

    def summary(self):
        t = self.steps
        rows = {}
        for k, (p, cols) in self.weights.items():
            if self.sum[k] is None:
                continue
            s1, s2 = self.sum[k], self.sum_sq[k]
            drift = (s1.abs() / (t * s2).sqrt().clamp_min(1e-30)).mean()
            w0, w1 = self.start[k], self._part(p, cols).detach()
            rows[k] = {"drift": float(drift), "grad_rms": float((s2 / t).mean().sqrt()),
                       "moved": float((w1 - w0).norm() / w0.norm().clamp_min(1e-30)),
                       "std_start": float(w0.std()), "std_end": float(w1.std())}
        return {"steps": t, "noise_floor": math.sqrt(2 / (math.pi * max(t, 1))),
                "weights": rows}


def report(summary):
    lines = [f"{summary['steps']} steps; drift of a gradient without a steady direction ≈ "
             f"{summary['noise_floor']:.3f}.", "",
             "| weight | drift | gradient RMS | moved ‖w_T − w_0‖/‖w_0‖ | std start → end |",
             "|---|---|---|---|---|"]
    for k, r in summary["weights"].items():
        lines.append(f"| {k} | {r['drift']:.3f} | {r['grad_rms']:.2e} | {r['moved']:.3f} | "
                     f"{r['std_start']:.4f} → {r['std_end']:.4f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a stage's saved config.yaml")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides (KEY VALUE ...)")
    a = ap.parse_args(argv)
    out = os.path.abspath(a.out)
    cfg = resolve_cfg(build_cfg(a.config, [*a.opts, "OUTPUT_DIR", os.path.join(out, "train"),
                                           "NUM_THREADS", str(a.threads)]))
    torch.set_num_threads(a.threads)
    setup_logger(name="detectron2")
    trainer = trainer_class(cfg)(cfg)
    trainer.resume_or_load(resume=False)
    recorder = GradientRecorder(tracked_weights(trainer.model))
    trainer.register_hooks([recorder])
    trainer.train()
    summary = recorder.summary()
    text = f"Config {a.config}; overrides {a.opts}.\n\n" + report(summary)
    atomic_write_text(os.path.join(out, "lcm_grad.md"), text + "\n")
    atomic_write_json(os.path.join(out, "lcm_grad.json"),
                      {"config": a.config, "opts": a.opts, **summary}, indent=1)
    print("\n" + text)


if __name__ == "__main__":
    main()
