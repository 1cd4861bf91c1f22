#!/usr/bin/env python
"""The paper's rows over several seeds on one dataset, ending in the paper-style table.

  python tools/run_experiments.py --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --seeds 0 1 2 --out output/cbis_r1_8 [--configs configs/demo] [--num-gpus 8]

Per seed, tools/run_pipeline.py with every method (default: the rows of the paper's Table 5:
CAM only, Faster R-CNN, Faster R-CNN + MV, SSL single view, MV + SSL (Mean Teacher),
BRAIxDet) into <out>/s<seed>/, stage-1 models shared by the rows that use them. Then, as in the
paper's tables: mean ± std (ddof=1) over seeds of AP@0.2 and Recall@0.5 FPPI per row, the
stage-1 classifiers' AUC, and the one-tailed Welch t-test of BRAIxDet against the second best
row (scipy, tools/summarize_runs.py). Written to <out>/summary.md and summary.json. The same
command runs on a CPU at demo size (--configs configs/demo) and on GPUs at the paper's size;
re-running continues where it stopped.
"""
import argparse
import json
import math
import os
import sys
import time
from collections import OrderedDict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run_pipeline  # noqa: E402
from summarize_runs import summarize  # noqa: E402

OURS = "BRAIxDet"
DEFAULT_METHODS = ["cam_only", "faster_rcnn", "faster_rcnn_mv", "ssl_single_view",
                   "mean_teacher", "braixdet"]
METRICS = ("AP20", "R@0.5")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", default="output/experiments")
    args, rest = ap.parse_known_args(argv)
    if "--methods" not in rest:
        rest += ["--methods", *DEFAULT_METHODS]
    return args, rest


def seed_args(rest, seed, out):
    """run_pipeline arguments for one seed (its own split, stage 1 and folder)."""
    return run_pipeline.parse_args([*rest, "--seed", str(seed),
                                    "--out", os.path.join(out, f"s{seed}")])


def _fmt(mean, std):
    if mean is None or math.isnan(mean):
        return "n/a"
    return f"{mean:.1f} ± {std:.1f}" if not math.isnan(std) else f"{mean:.1f}"


def paper_table(per_seed):
    """per_seed: [run_pipeline summary] -> (markdown, summary dict)."""
    values = OrderedDict()
    for s in per_seed:
        for label, m in s["results"].items():
            m = m.get("bbox", m)
            values.setdefault(label, []).append({k: float(m[k]) for k in METRICS})
    means = {k: float(np.mean([r["AP20"] for r in v])) for k, v in values.items()}
    others = sorted((k for k in values if k != OURS), key=lambda k: -means[k])
    second = others[0] if OURS in values and others else None
    rows = summarize(values, second or next(iter(values)), METRICS)
    by_label = {r["method"]: r for r in rows}
    lines = ["| Method | AP@IoU0.2 (%) | Recall@0.5 FPPI (%) |", "|---|---|---|"]
    for label in values:
        r = by_label[label]
        lines.append(f"| {label} | " + " | ".join(
            _fmt(r[f"{m}_mean"], r[f"{m}_std"]) for m in METRICS) + " |")
    if second is not None:
        p = [by_label[OURS][f"{m}_p"] for m in METRICS]
        lines.append(f"| {OURS} (p-value vs {second}, one-tailed t-test) | " + " | ".join(
            "n/a" if math.isnan(x) else f"{x:.4f}" for x in p) + " |")

    cls = OrderedDict()
    for s in per_seed:
        for name, m in s.get("classifiers", {}).items():
            for split in ("val", "test"):
                auc = m.get(split, {}).get("AUC")
                cls.setdefault(name, {}).setdefault(split, []).append(
                    float("nan") if auc is None else float(auc))
    lines += ["", "| Stage-1 classifier | val AUC | test AUC |", "|---|---|---|"]
    for name, d in cls.items():
        lines.append(f"| {name} | " + " | ".join(
            f"{np.mean(d[s]):.3f} ± {np.std(d[s], ddof=1) if len(d[s]) > 1 else 0:.3f}"
            for s in ("val", "test")) + " |")
    quality = [s["cam_quality"] for s in per_seed if s.get("cam_quality")]
    if quality:
        lines += ["", "GradCAM pseudo-boxes on D_w (boxes withheld by the protocol): "
                  f"{100 * np.mean([q['box_hit_rate'] for q in quality]):.1f}% of boxes hit a "
                  f"lesion, {100 * np.mean([q['lesion_hit_rate'] for q in quality]):.1f}% of "
                  "lesions hit (IoU >= 0.2; mean over seeds)."]
    summary = {"rows": rows, "second_best": second, "classifiers": cls,
               "seeds": [s["protocol"]["seed"] for s in per_seed]}
    return "\n".join(lines), summary


def main(argv=None):
    args, rest = parse_args(argv)
    out = os.path.abspath(args.out)
    per_seed = []
    t0 = time.time()
    for i, seed in enumerate(args.seeds):
        print(f"\n##### seed {seed} ({i + 1}/{len(args.seeds)}), "
              f"{(time.time() - t0) / 60:.1f} min so far", flush=True)
        per_seed.append(run_pipeline.Pipeline(seed_args(rest, seed, out)).run_all())
    md, summary = paper_table(per_seed)
    summary["minutes"] = round((time.time() - t0) / 60, 1)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(md + f"\n\nSeeds {args.seeds}; mean ± std (ddof=1).\n")
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print("\n" + md)
    print(f"\nwrote {out}/summary.md and summary.json ({summary['minutes']} min)")
    return summary


if __name__ == "__main__":
    main()
