#!/usr/bin/env python
"""Pseudo-label score thresholds of the SSL competitors for one class, on a development set.

  python benchmarks/experiment_pseudo_threshold.py --root out/dev_wide --out out/thresh \
      --methods unbiased_teacher stac soft_teacher --thresholds 0.5 0.7 0.9 --seeds 0

The official values (Unbiased Teacher 0.7, STAC 0.9, Soft Teacher 0.9 for its RPN/classification
boxes) were set for an 81-way softmax on COCO; ours has two outputs. For each method, threshold
and seed: one pipeline run (braixdet/pipeline, demo configs, ratio --ratio) into
<out>/<method>/t<threshold>/s<seed> with the threshold as a detector override
(SSL.TEACHER_SCORE_THRESH; Soft Teacher: SSL.SOFT_TEACHER_CLS_THRESH, its 0.5 candidate filter
lowered with it when the threshold is below 0.5). Stage 1 and STAC's supervised teacher are
trained once per seed and copied into the other runs of that seed. The threshold is SELECTED on
validation (the exported model's best validation AP@0.2, never the test set); the test metrics
of every cell are written beside it. Writes <out>/thresholds.md and thresholds.json. The
development set is generated under --root when absent (experiment_ratio_grid.py's set B).
Not part of `make bench` (hours of CPU).
"""
import argparse
import os
import shutil
import time

import numpy as np
from experiment_ratio_grid import add_dev_set_arguments, make_dev_set, run_args

from braixdet.engine.hooks import read_export_selection
from braixdet.pipeline.core import Pipeline
from braixdet.pipeline.methods import METHODS, STAGE1
from braixdet.pipeline.results import METRICS, _flat
from braixdet.utils.io import atomic_write_json, atomic_write_text

COMPETITORS = ("unbiased_teacher", "stac", "soft_teacher")
SHARED = (*STAGE1, "faster_rcnn")  # trained once per seed: threshold-independent


def threshold_opts(method, t):
    """The detector overrides that set ``method``'s pseudo-label threshold to ``t``."""
    if method == "soft_teacher":
        return ["SSL.SOFT_TEACHER_CLS_THRESH", str(t),
                "SSL.TEACHER_SCORE_THRESH", str(min(t, 0.5))]
    return ["SSL.TEACHER_SCORE_THRESH", str(t)]


def share(src, dst):
    """Copy the finished threshold-independent stages of one run of a seed into another."""
    for name in SHARED:
        if os.path.exists(os.path.join(src, name, "stage_done.json")) and \
                not os.path.exists(os.path.join(dst, name)):
            shutil.copytree(os.path.join(src, name), os.path.join(dst, name), symlinks=True)


def validation_value(run_dir, method):
    """The exported model's selection value (best validation AP@0.2), or NaN."""
    path = os.path.join(run_dir, method, "model_export.pth")
    if not os.path.exists(path):
        return float("nan")
    value = read_export_selection(path).get("value")
    return float("nan") if value is None else float(value)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", nargs="+", default=list(COMPETITORS), choices=COMPETITORS)
    ap.add_argument("--thresholds", nargs="+", type=float, default=[0.5, 0.7, 0.9])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--ratio", default="1/8")
    add_dev_set_arguments(ap)
    a = ap.parse_args(argv)
    make_dev_set(a)
    out, t0 = os.path.abspath(a.out), time.time()
    cells = {}
    for seed in a.seeds:
        done = []  # this seed's earlier runs: stage 1 from the first, STAC's teacher from any
        for method in a.methods:
            for t in a.thresholds:
                run_dir = os.path.join(out, method, f"t{t:g}", f"s{seed}")
                os.makedirs(run_dir, exist_ok=True)
                for src in done:
                    share(src, run_dir)
                methods = ["faster_rcnn", method] if method == "stac" else [method]
                print(f"\n##### seed {seed}, {method}, threshold {t:g} "
                      f"({(time.time() - t0) / 60:.1f} min so far)", flush=True)
                summary = Pipeline(run_args(a, "partial", a.ratio, seed, run_dir, methods,
                                            threshold_opts(method, t))).run_all()
                done.append(run_dir)
                test = _flat(summary["results"][METHODS[method].label])
                cells.setdefault((method, t), []).append({
                    "val_AP": validation_value(run_dir, method),
                    **{f"test_{m}": float(test.get(m, float("nan"))) for m in METRICS}})
    lines = [f"Development set {a.root}; ratio {a.ratio}; seeds {a.seeds}; mean over seeds. "
             "Selection: the best validation AP@0.2 per method.", "",
             "| method | threshold | val AP@0.2 | test AP@0.2 | test R@0.5 | selected |",
             "|---|---|---|---|---|---|"]
    table = {}
    for method in a.methods:
        rows = {t: {k: float(np.nanmean([c[k] for c in cells[(method, t)]]))
                    for k in ("val_AP", *(f"test_{m}" for m in METRICS))} for t in a.thresholds}
        vals = {t: r["val_AP"] for t, r in rows.items() if not np.isnan(r["val_AP"])}
        best = max(vals, key=vals.get) if vals else None
        table[method] = {"rows": {f"{t:g}": r for t, r in rows.items()}, "selected": best}
        for t, r in rows.items():
            lines.append(f"| {method} | {t:g} | {r['val_AP']:.1f} | {r['test_AP20']:.1f} | "
                         f"{r['test_R@0.5']:.1f} | {'**yes**' if t == best else ''} |")
    md = "\n".join(lines) + f"\n\n{(time.time() - t0) / 60:.1f} min.\n"
    atomic_write_text(os.path.join(out, "thresholds.md"), md)
    atomic_write_json(os.path.join(out, "thresholds.json"), table, indent=1)
    print("\n" + md)


if __name__ == "__main__":
    main()
