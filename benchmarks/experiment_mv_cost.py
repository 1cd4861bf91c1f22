#!/usr/bin/env python
"""Where the multi-view cost comes from: the detector or the classifier it starts from.

  python benchmarks/experiment_mv_cost.py --root out/dev_b --out out/mv_cost --seeds 0 1 2 3 4

Issue 27 item 4, docs/RESULTS.md §15. On a development set (generated when --root holds none;
set B of RESULTS §2.1 by default), per seed one pipeline run at --ratio of the 2×2 grid
{single-view, multi-view detector} × {single-view classifier, BRAIxMVCCL export}: faster_rcnn,
faster_rcnn_mvccl_init, faster_rcnn_mv_sv_init and faster_rcnn_mv, sharing the seed's stage 1.
Writes <out>/mv_cost.md and mv_cost.json: each effect paired by seed (mean, 95% t interval,
paired t and Wilcoxon p) and the verdict of the criteria written down before the runs
(``verdict``). Re-running continues (done-markers). Not part of `make bench`.
"""
import argparse
import os
import time

import numpy as np
from experiment_ratio_grid import add_dev_set_arguments, make_dev_set, run_args

from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import fmt_cell, paired_effect, paired_values
from braixdet.pipeline.seeds import run_seeds
from braixdet.utils.io import atomic_write_json, atomic_write_text

ROWS = ["faster_rcnn", "faster_rcnn_mvccl_init", "faster_rcnn_mv_sv_init", "faster_rcnn_mv"]
# name -> (with, without): each effect is AP(with) - AP(without), paired by seed
EFFECTS = {
    "MV cost, as in Table 6": ("faster_rcnn_mv", "faster_rcnn"),
    "detector, single-view classifier init": ("faster_rcnn_mv_sv_init", "faster_rcnn"),
    "detector, BRAIxMVCCL init": ("faster_rcnn_mv", "faster_rcnn_mvccl_init"),
    "init, single-view detector": ("faster_rcnn_mvccl_init", "faster_rcnn"),
    "init, multi-view detector": ("faster_rcnn_mv", "faster_rcnn_mv_sv_init"),
}


BOTH_INITS = "init, both detectors (mean)"


def effects_of(per_seed, metric="AP20"):
    """{effect name: results.paired_effect of its two rows over the seeds that have both}."""
    out = {}
    for name, (a, b) in EFFECTS.items():
        out[name] = paired_effect(*paired_values(per_seed, METHODS[a].label,
                                                  METHODS[b].label, metric))
        out[name]["rows"] = [a, b]
    # the two init effects averaged per seed (RESULTS §15's amendment, H2)
    rows = [paired_values(per_seed, METHODS[a].label, METHODS[b].label, metric)
            for a, b in (EFFECTS["init, single-view detector"],
                         EFFECTS["init, multi-view detector"])]
    if len(rows[0][0]) == len(rows[1][0]):
        out[BOTH_INITS] = paired_effect(np.mean([rows[0][0], rows[1][0]], axis=0),
                                        np.mean([rows[0][1], rows[1][1]], axis=0))
        out[BOTH_INITS]["rows"] = ["faster_rcnn_mvccl_init, faster_rcnn_mv",
                                   "faster_rcnn, faster_rcnn_mv_sv_init"]
    return out


def verdict(effects):
    """RESULTS §15's criteria: 'architecture' when the multi-view detector costs at both inits
    (intervals below 0) and the init matters at neither (intervals include 0); 'initialisation'
    the other way round; no attribution without a deficit whose interval excludes 0."""
    def below(e):
        return e["ci_high"] < 0

    def spans_zero(e):
        return e["ci_low"] <= 0 <= e["ci_high"]

    if not below(effects["MV cost, as in Table 6"]):
        return "no deficit whose 95% interval excludes 0: not attributed"
    detector = [effects[k] for k in EFFECTS if k.startswith("detector")]
    init = [effects[k] for k in EFFECTS if k.startswith("init")]
    if all(map(below, detector)) and all(map(spans_zero, init)):
        return "architecture (the multi-view detector)"
    if all(map(below, init)) and all(map(spans_zero, detector)):
        return "initialisation (the BRAIxMVCCL export)"
    return "not attributed at this precision"


def report(per_seed, root, seeds):
    effects = effects_of(per_seed)
    lines = [f"Development set {root}; seeds {seeds}; AP@IoU0.2 (%) on the test split.", "",
             "| row | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for key in ROWS:
        label = METHODS[key].label
        lines.append(f"| {label} | " + " | ".join(
            fmt_cell(float(s["results"][label].get("bbox", s["results"][label])["AP20"]), ".1f")
            if label in s["results"] else "—" for s in per_seed) + " |")
    lines += ["", "| effect | with − without | seeds | mean [95% CI] | paired t p | Wilcoxon p |",
              "|---|---|---|---|---|---|"]
    for name, e in effects.items():
        a, b = (" and ".join(METHODS[k].label for k in keys.split(", ")) for keys in e["rows"])
        lines.append(f"| {name} | {a} − {b} | {e['n']} | {fmt_cell(e['mean'], '+.1f')} "
                     f"[{fmt_cell(e['ci_low'], '+.1f')}, {fmt_cell(e['ci_high'], '+.1f')}] | "
                     f"{fmt_cell(e['p_t'], '.4f')} | {fmt_cell(e['p_wilcoxon'], '.4f')} |")
    answer = verdict(effects)
    lines += ["", f"Verdict (RESULTS §15's criteria): **{answer}**."]
    return "\n".join(lines), effects, answer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--ratio", default="1/8")
    add_dev_set_arguments(ap)
    a = ap.parse_args(argv)
    make_dev_set(a)
    out, t0 = os.path.abspath(a.out), time.time()
    run_dir = os.path.join(out, "r" + a.ratio.replace("/", "_"))
    per_seed = run_seeds(run_args(a, "partial", a.ratio, 0, run_dir, ROWS), a.seeds, run_dir)
    text, effects, answer = report(per_seed, a.root, a.seeds)
    text += f"\n\n{(time.time() - t0) / 60:.1f} min.\n"
    atomic_write_text(os.path.join(out, "mv_cost.md"), text)
    atomic_write_json(os.path.join(out, "mv_cost.json"),
                      {"root": a.root, "seeds": a.seeds, "ratio": a.ratio, "effects": effects,
                       "verdict": answer, "per_seed": [s["results"] for s in per_seed]},
                      indent=1)
    print("\n" + text)


if __name__ == "__main__":
    main()
