#!/usr/bin/env python
"""Does a trained multi-view detector use its second view? Test AP with the view swapped out.

  python benchmarks/experiment_aux_view.py --runs out/mv_cost/r1_8 --rows faster_rcnn_mv_sv_init \
      --out out/aux_view

docs/RESULTS.md §24. For each seed folder s<N> under --runs and each multi-view row, the row's
exported model is evaluated on the test split four times, three changing only the auxiliary image:
``paired`` (the other view of the same breast, as trained), ``main`` (the main image itself:
whatever the main view shows, the second view now shows too) and ``other breast`` (the other
view of another patient's breast with the same laterality). A detector that ignores its second
view scores the same on all three. ``paired, LCM off`` zeroes the LCM attentions' cross-view
fuse weights (lcm_cross_view_off): whether their output matters at all, whatever it carries.
Writes <out>/aux_view.md and aux_view.json: AP@0.2 per seed and each change paired by seed
(mean, 95% t interval, paired t p), and the scale of the LCM's cross-view weights in each
export against their initial scale (``lcm_cross_view_scale``).
``--rows mvccl`` asks the same of the stage-1 BRAIxMVCCL classifier, by its test AUC.
Not part of `make bench`.
"""
import argparse
import contextlib
import copy
import hashlib
import math
import os
import random

import numpy as np
import torch
from detectron2.evaluation import inference_on_dataset

from braixdet.config import build_cfg, resolve_cfg
from braixdet.data.build import build_multiview_test_loader, get_dicts
from braixdet.engine import trainer_class
from braixdet.modeling.lcm import (
    CrossViewAttention,
    cross_view_init_std,
    fuse_weight_parts,
    fuse_weight_slices,
)
from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import (
    fmt_cell,
    fmt_effect,
    paired_effect,
    row_metric,
    seed_table,
)
from braixdet.utils.checkpoint import load_inference_weights
from braixdet.utils.io import atomic_write_json, atomic_write_text

TEST = "cbis_ddsm_test"
# the stage-1 classifier (``--rows mvccl``): image-level AUC on the classification test split
CLASSIFIER, TEST_CLS = "mvccl", "cbis_ddsm_test_cls"
VARIANTS = ("paired", "main", "other breast", "paired, LCM off")
LCM_OFF = VARIANTS[3]


def swap_aux(dicts, variant, seed=0):
    """Copies of ``dicts`` whose auxiliary image is ``variant`` (module docstring)."""
    out = copy.deepcopy(dicts)
    if variant in ("paired", LCM_OFF):
        return out
    if variant == "main":
        for d in out:
            d["aux_file_name"] = d["file_name"]
        return out
    rng = random.Random(seed)
    for d in out:
        # the donor's own paired view: the view the model expects, from another patient
        donors = [e for e in dicts if e.get("aux_file_name") and e["file_name"] != d["file_name"]
                  and e.get("patient_id") != d.get("patient_id")
                  and e.get("laterality") == d.get("laterality") and e["view"] == d["view"]]
        d["aux_file_name"] = rng.choice(donors)["aux_file_name"]
    return out


def lcm_cross_view_scale(state_dict, gain=0.1):
    """(std of the LCM fuse conv's weights on the cross-view features, their std at
    initialisation, mean of its diagonal on the view's own features) of a model's
    ``state_dict``: the fuse starts as identity on the view's features plus a small
    cross-view part of std gain/sqrt(D') (modeling/lcm.py; ``gain``: the run's
    LCM.CROSS_VIEW_INIT_GAIN)."""
    w = next(v for k, v in state_dict.items() if k.endswith("lcm.to_main.fuse.weight"))
    own, cross = fuse_weight_parts(w[:, :, 0, 0])
    return (float(cross.std()), cross_view_init_std(gain, cross.shape[1]),
            float(own.diagonal().mean()))


@contextlib.contextmanager
def lcm_cross_view_off(model):
    """Within: every LCM attention's cross-view fuse weights are 0, so its output is the
    view's own features through the fuse's own part; restored on exit."""
    saved = []
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, CrossViewAttention):
                w = fuse_weight_parts(m.fuse.weight)[1]
                saved.append((w, w.clone()))
                w.zero_()
    try:
        yield model
    finally:
        with torch.no_grad():
            for w, value in saved:
                w.copy_(value)


def lcm_probe(model, loader):
    """(mean attention entropy / log(number of keys), mean ||cross-view part|| / ||own part|| of
    the LCM fuse conv's output) over ``loader``: how selective the cross-view attention is, and
    how much of the fused features comes from the other view."""
    cva = getattr(model, "backbone", model).bottom_up.lcm.to_main  # detector or classifier
    entropy, ratio = [], []

    def want_weights(mod, args, kwargs):
        return args, dict(kwargs, need_weights=True, average_attn_weights=False)

    def attention(mod, args, out):
        w = out[1]  # (B, heads, queries, keys)
        h = -(w.clamp_min(1e-12).log() * w).sum(-1) / math.log(w.shape[-1])
        entropy.append(float(h.mean()))

    def fuse(mod, args, out):
        x, (own_in, cross_in) = args[0], fuse_weight_slices(mod.weight)
        own = torch.nn.functional.conv2d(x[:, own_in], mod.weight[:, own_in])
        cross = torch.nn.functional.conv2d(x[:, cross_in], mod.weight[:, cross_in])
        ratio.append(float(cross.norm() / own.norm()))

    hooks = [cva.attn.register_forward_pre_hook(want_weights, with_kwargs=True),
             cva.attn.register_forward_hook(attention), cva.fuse.register_forward_hook(fuse)]
    try:
        with torch.no_grad():
            for batch in loader:
                model(batch)
    finally:
        for h in hooks:
            h.remove()
    return float(np.mean(entropy)), float(np.mean(ratio))


def evaluate(run_dir, variants=VARIANTS, threads=1, probe=0, opts=()):
    """{variant: AP@0.2} of the exported model in ``run_dir`` on the test split, "lcm_scale":
    its lcm_cross_view_scale, and with ``probe`` > 0 "probe": lcm_probe over that many test
    images. ``opts``: config overrides for the evaluation (e.g. a TEST.BRAIXDET option); its
    outputs then go to folders of their own."""
    cfg = build_cfg(os.path.join(run_dir, "config.yaml"),
                    ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", "NUM_THREADS", str(threads),
                     *opts])
    suffix = ("_" + hashlib.sha1(" ".join(opts).encode()).hexdigest()[:8]) if opts else ""
    cfg = resolve_cfg(cfg)
    torch.set_num_threads(threads)
    trainer = trainer_class(cfg)
    model = trainer.build_model(cfg)
    load_inference_weights(model, os.path.join(run_dir, "model_export.pth"))
    model.eval()
    classifier = cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier"
    test = TEST_CLS if classifier else TEST
    dicts = get_dicts(test)
    result = {"lcm_scale": lcm_cross_view_scale(
        model.state_dict(), cfg.MODEL.BRAIXDET.LCM.CROSS_VIEW_INIT_GAIN)}
    for v in variants:
        folder = os.path.join(run_dir, "inference", "aux_" + v.replace(" ", "_") + suffix, test)
        with lcm_cross_view_off(model) if v == LCM_OFF else contextlib.nullcontext():
            res = inference_on_dataset(
                model, build_multiview_test_loader(cfg, swap_aux(dicts, v)),
                trainer.build_evaluator(cfg, test, folder))
        result[v] = 100 * res["classification"]["AUC"] if classifier else row_metric(res, "AP20")
        print(f"   {run_dir}: aux {v}: {'AUC' if classifier else 'AP@0.2'} {result[v]:.1f}",
              flush=True)
    if probe:
        result["probe"] = lcm_probe(model, build_multiview_test_loader(cfg, dicts[:probe]))
        print(f"   {run_dir}: attention entropy {result['probe'][0]:.3f} of its maximum, "
              f"cross-view / own features {result['probe'][1]:.4f}", flush=True)
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="a folder of seed folders s<N> (run_seeds)")
    ap.add_argument("--rows", nargs="+", default=["faster_rcnn_mv_sv_init", "faster_rcnn_mv"],
                    choices=[k for k in METHODS if "mv" in k] + [CLASSIFIER],
                    help=f"multi-view rows; {CLASSIFIER!r}: the BRAIxMVCCL classifier (test AUC)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probe", type=int, default=0,
                    help="also lcm_probe on this many test images (attention, cross-view share)")
    ap.add_argument("--opts", nargs="+", default=[],
                    help="config overrides for every evaluation, KEY VALUE ... (e.g. "
                         "TEST.BRAIXDET.IMAGE_SCORE_GATE True)")
    a = ap.parse_args(argv)
    seeds = sorted(int(n[1:]) for n in os.listdir(a.runs) if n[1:].isdigit() and n[0] == "s")
    per_row, lines = {}, []
    for row in a.rows:
        ap_ = {s: evaluate(os.path.join(a.runs, f"s{s}", row), threads=a.threads, probe=a.probe,
                           opts=a.opts)
               for s in seeds if os.path.exists(os.path.join(a.runs, f"s{s}", row,
                                                             "model_export.pth"))}
        done = sorted(ap_)
        label, metric = ((f"BRAIxMVCCL ({CLASSIFIER})", "AUC × 100") if row == CLASSIFIER
                         else (METHODS[row].label, "AP@0.2"))
        lines += [f"**{label}**, seeds {done}, test {metric}:", "",
                  *seed_table("aux image", {v: [ap_[s][v] for s in done] for v in VARIANTS},
                              done)]
        effects = {v: paired_effect([ap_[s]["paired"] for s in done], [ap_[s][v] for s in done])
                   for v in VARIANTS[1:]}
        lines += ["", "| paired − swapped | mean [95% CI] | paired t p |", "|---|---|---|"]
        for v, e in effects.items():
            lines.append(f"| paired − {v} | {fmt_effect(e)} | {fmt_cell(e['p_t'], '.4f')} |")
        scale = {s: ap_[s]["lcm_scale"] for s in done}
        lines += ["", "LCM cross-view weights, std (at initialisation "
                  f"{scale[done[0]][1]:.4f}) per seed: "
                  + ", ".join(f"{scale[s][0]:.4f}" for s in done)
                  + "; own-feature diagonal: " + ", ".join(f"{scale[s][2]:.3f}" for s in done), ""]
        if a.probe:
            lines += ["Attention entropy / its maximum per seed: "
                      + ", ".join(f"{ap_[s]['probe'][0]:.3f}" for s in done)
                      + "; cross-view / own part of the fused features: "
                      + ", ".join(f"{ap_[s]['probe'][1]:.4f}" for s in done), ""]
        per_row[row] = {"ap": {str(s): ap_[s] for s in done}, "effects": effects,
                        "lcm_cross_view_scale": {str(s): scale[s] for s in done}}
    text = "\n".join(lines)
    os.makedirs(a.out, exist_ok=True)
    atomic_write_text(os.path.join(a.out, "aux_view.md"), text + "\n")
    atomic_write_json(os.path.join(a.out, "aux_view.json"),
                      {"runs": a.runs, "opts": a.opts, "rows": per_row}, indent=1)
    print("\n" + text)


if __name__ == "__main__":
    main()
