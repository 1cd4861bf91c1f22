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
from braixdet.pipeline.results import fmt_cell, fmt_effect, paired_effect, row_metric
from braixdet.pipeline.seeds import run_seeds
from braixdet.utils.io import atomic_write_json, atomic_write_text

BOTH_INITS = "init, both detectors (mean)"
ROWS = ["faster_rcnn", "faster_rcnn_mvccl_init", "faster_rcnn_mv_sv_init", "faster_rcnn_mv"]
# name -> (with, without), each a tuple of rows: the effect is mean AP(with) - mean AP(without)
# per seed, paired by seed
EFFECTS = {
    "MV cost, as in Table 6": (("faster_rcnn_mv",), ("faster_rcnn",)),
    "detector, single-view classifier init": (("faster_rcnn_mv_sv_init",), ("faster_rcnn",)),
    "detector, BRAIxMVCCL init": (("faster_rcnn_mv",), ("faster_rcnn_mvccl_init",)),
    "init, single-view detector": (("faster_rcnn_mvccl_init",), ("faster_rcnn",)),
    "init, multi-view detector": (("faster_rcnn_mv",), ("faster_rcnn_mv_sv_init",)),
    # the two init effects averaged per seed (RESULTS §15's amendment, H2)
    BOTH_INITS: (("faster_rcnn_mvccl_init", "faster_rcnn_mv"),
                 ("faster_rcnn", "faster_rcnn_mv_sv_init")),
}
# the effects RESULTS §15's verdict reads
COST = "MV cost, as in Table 6"
DETECTOR = ("detector, single-view classifier init", "detector, BRAIxMVCCL init")
INIT = ("init, single-view detector", "init, multi-view detector")


def grid_values(per_seed, rows=ROWS, metric="AP20"):
    """{row key: [its metric per seed]} over the seeds that have every one of ``rows``."""
    complete = [s["results"] for s in per_seed
                if all(METHODS[k].label in s["results"] for k in rows)]
    return {k: np.array([row_metric(r[METHODS[k].label], metric) for r in complete])
            for k in rows}


def effects_of(per_seed, effects=EFFECTS, rows=ROWS, metric="AP20"):
    """{effect name: results.paired_effect of its two sides, paired by seed}; ``effects``:
    name -> (with, without), each a tuple of row keys averaged per seed. Effects that need a
    row outside ``rows`` are left out."""
    values = grid_values(per_seed, rows, metric)
    effects = {k: v for k, v in effects.items() if set(v[0] + v[1]) <= set(rows)}

    def side(keys):
        return np.mean([values[k] for k in keys], axis=0)

    return {name: dict(paired_effect(side(a), side(b)), rows=[list(a), list(b)])
            for name, (a, b) in effects.items()}


def verdict(effects):
    """RESULTS §15's criteria: 'architecture' when the multi-view detector costs at both inits
    (intervals below 0) and the init matters at neither (intervals include 0); 'initialisation'
    the other way round; no attribution without a deficit whose interval excludes 0."""
    def below(e):
        return e["ci_high"] < 0

    def spans_zero(e):
        return e["ci_low"] <= 0 <= e["ci_high"]

    if not below(effects[COST]):
        return "no deficit whose 95% interval excludes 0: not attributed"
    detector, init = [effects[k] for k in DETECTOR], [effects[k] for k in INIT]
    if all(map(below, detector)) and all(map(spans_zero, init)):
        return "architecture (the multi-view detector)"
    if all(map(below, init)) and all(map(spans_zero, detector)):
        return "initialisation (the BRAIxMVCCL export)"
    return "not attributed at this precision"


def row_table(per_seed, seeds, labels):
    """Markdown lines: one line per results row (``labels``), its AP@0.2 per seed."""
    lines = ["| row | " + " | ".join(f"seed {s}" for s in seeds) + " |",
             "|---|" + "---|" * len(seeds)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(
            fmt_cell(row_metric(s["results"][label]), ".1f") if label in s["results"] else "—"
            for s in per_seed) + " |")
    return lines


def effects_table(effects):
    """Markdown lines: each effect's two sides, seeds, mean [95% CI] and p-values."""
    lines = ["| effect | with − without | seeds | mean [95% CI] | paired t p | Wilcoxon p |",
             "|---|---|---|---|---|---|"]
    for name, e in effects.items():
        a, b = (" and ".join(METHODS[k].label if k in METHODS else k for k in keys)
                for keys in e["rows"])
        lines.append(f"| {name} | {a} − {b} | {e['n']} | {fmt_effect(e)} | "
                     f"{fmt_cell(e['p_t'], '.4f')} | {fmt_cell(e['p_wilcoxon'], '.4f')} |")
    return lines


def report(per_seed, root, seeds, rows=ROWS):
    effects = effects_of(per_seed, rows=rows)
    # §15's criteria read every effect of the 2x2 grid
    answer = verdict(effects) if set(rows) == set(ROWS) else "not read (a part of the grid)"
    lines = [f"Development set {root}; seeds {seeds}; AP@IoU0.2 (%) on the test split.", "",
             *row_table(per_seed, seeds, [METHODS[k].label for k in rows]), "",
             *effects_table(effects), "",
             f"Verdict (RESULTS §15's criteria): **{answer}**."]
    return "\n".join(lines), effects, answer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--ratio", default="1/8")
    ap.add_argument("--protocol", default="partial", choices=["partial", "full"],
                    help="full: every training box (paper Table 6's protocol); --ratio unused")
    ap.add_argument("--rows", nargs="+", default=ROWS, choices=ROWS,
                    help="a part of the grid (stage 1 trains only the classifiers they need)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per stage (NUM_THREADS; 0: the config's). 1 when two "
                         "processes share two cores: more threads than cores slow both")
    ap.add_argument("--opts", nargs="+", default=[],
                    help="config overrides for every stage, KEY VALUE ... (a candidate fix, "
                         "e.g. MODEL.BRAIXDET.LCM.LR_FACTOR 10; RESULTS §25)")
    ap.add_argument("--det-opts", nargs="+", default=[],
                    help="config overrides for the detectors only (a detector option such as "
                         "MODEL.BRAIXDET.LCM.EXTRA_FEATURES \"['res4']\", which the classifier "
                         "refuses)")
    ap.add_argument("--stage1-opts", nargs="+", default=[],
                    help="config overrides for the stage-1 classifiers only")
    add_dev_set_arguments(ap)
    a = ap.parse_args(argv)
    make_dev_set(a)
    out, t0 = os.path.abspath(a.out), time.time()
    run_dir = os.path.join(out, "full" if a.protocol == "full" else
                           "r" + a.ratio.replace("/", "_"))
    rows = [k for k in ROWS if k in a.rows]
    args = run_args(a, a.protocol, a.ratio, 0, run_dir, rows, det_opts=a.det_opts,
                    threads=a.threads)
    args.opts = [*args.opts, *a.opts]
    args.stage1_opts = [*args.stage1_opts, *a.stage1_opts]
    per_seed = run_seeds(args, a.seeds, run_dir)
    text, effects, answer = report(per_seed, a.root, a.seeds, rows)
    text += f"\n\n{(time.time() - t0) / 60:.1f} min.\n"
    atomic_write_text(os.path.join(out, "mv_cost.md"), text)
    atomic_write_json(os.path.join(out, "mv_cost.json"),
                      {"root": a.root, "seeds": a.seeds, "protocol": a.protocol, "ratio": a.ratio,
                       "rows": rows, "opts": a.opts, "stage1_opts": a.stage1_opts,
                       "det_opts": a.det_opts, "effects": effects,
                       "verdict": answer, "per_seed": [s["results"] for s in per_seed]},
                      indent=1)
    print("\n" + text)


if __name__ == "__main__":
    main()
