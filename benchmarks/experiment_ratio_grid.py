#!/usr/bin/env python
"""Where should BRAIxDet's GradCAM fusion show? Label ratios x seeds on a development set.

  python benchmarks/experiment_ratio_grid.py --root out/dev_wide --out out/grid \
      --ratios 1/16 1/8 1/4 --seeds 0 1 2 --methods mean_teacher braixdet --ceiling

The development set is generated under --root when absent (default: development set B of
docs/RESULTS.md §2.1, not the demo's: generator seed 1, 100 patients, 512x416 films, lesion
separation 1.5, size_scale 0.8, size_spread 2).

For each seed and ratio: one pipeline run (braixdet/pipeline) with the demo configs into
<out>/r<ratio>/s<seed>; with --ceiling also the full-label ceiling (pipeline/ceiling.py) into
<out>/full/s<seed>. Stage 1 is trained once per seed and copied to the seed's other runs: its
data (train_all, val, test) do not depend on the ratio or the protocol (data/protocols.py), which
the script checks on the written splits. Re-running continues where it stopped (done-markers).
Writes <out>/grid.md and grid.json: per ratio, mean ± std over seeds of AP@0.2 and R@0.5 and
one-tailed Welch p-values of each row against --baseline. Not part of `make bench` (hours of
CPU); the table of docs/RESULTS.md §2.2 comes from it.
"""
import argparse
import os
import time

import numpy as np

from braixdet.pipeline.ceiling import run_ceiling, share_stage1, split_ids
from braixdet.pipeline.core import Pipeline, demo_config_args
from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import METRICS, summarize
from braixdet.utils.io import atomic_write_json, atomic_write_text

# The benchmark regimes' detectors keep the paper's (torchvision's) box head: their records
# (docs/results/, RESULTS §10-§34) trained it; the demo's configs narrowed it for the demo (§1.11).
BENCHMARK_DET_OPTS = ("MODEL.ROI_BOX_HEAD.FC_DIM", "1024")


def run_args(a, protocol, ratio, seed, out, methods, det_opts=(), threads=0):
    """The pipeline's arguments on the demo configs with the paper's box head
    (BENCHMARK_DET_OPTS, before ``det_opts``); ``threads`` > 0: torch threads of every stage
    (NUM_THREADS; 1 when two experiment processes share two cores)."""
    args = demo_config_args(a.root, out, size=a.size, stage1_epochs=a.stage1_epochs,
                            det_epochs=a.det_epochs, seed=seed, ratio=ratio, protocol=protocol,
                            methods=methods, det_opts=[*BENCHMARK_DET_OPTS, *det_opts],
                            cache_dir=os.path.join(os.path.abspath(a.out), "cache"))
    if threads:
        args.opts = [*args.opts, "NUM_THREADS", str(threads)]
    return args


def ratio_table(per_seed, baseline):
    values = {}
    for s in per_seed:
        for label, m in s["results"].items():
            m = m.get("bbox", m)
            values.setdefault(label, []).append({k: float(m[k]) for k in METRICS})
    return summarize(values, baseline if baseline in values else next(iter(values)))


def add_dev_set_arguments(ap):
    """The run size (demo configs at ``--size``) and the development set's generator settings
    (development set B of RESULTS §2.1 by default, read by ``make_dev_set``)."""
    ap.add_argument("--size", nargs=2, type=int, default=[256, 128])
    ap.add_argument("--stage1-epochs", type=float, default=5.0)
    ap.add_argument("--det-epochs", type=float, default=3.0)
    dev = ap.add_argument_group("the development set (generated when --root holds none)")
    dev.add_argument("--data-seed", type=int, default=1)
    dev.add_argument("--patients", type=int, default=100)
    dev.add_argument("--image-size", nargs=2, type=int, default=[512, 416])
    dev.add_argument("--separation", type=float, default=1.5)
    dev.add_argument("--size-scale", type=float, default=0.8)
    dev.add_argument("--size-spread", type=float, default=2.0)
    dev.add_argument("--summations-per-view", type=float, default=0.0,
                     help="one-view mass look-alikes per view (RESULTS §24)")


def make_dev_set(a):
    if os.path.exists(os.path.join(a.root, "exams.csv")):
        return
    from synthetic_mammo import make_synthetic_dataset

    print(f"=== [data] development set -> {a.root}", flush=True)
    make_synthetic_dataset(a.root, patients=a.patients, image_size=tuple(a.image_size),
                           lesion_rate=0.7, seed=a.data_seed, separation=a.separation,
                           size_scale=a.size_scale, size_spread=a.size_spread,
                           summations_per_view=a.summations_per_view)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--ratios", nargs="+", default=["1/16", "1/8", "1/4"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--methods", nargs="+", default=["mean_teacher", "braixdet"],
                    choices=list(METHODS))
    ap.add_argument("--baseline", default="mean_teacher", choices=list(METHODS))
    ap.add_argument("--ceiling", action="store_true",
                    help="also --protocol full Faster R-CNN (every box) per seed")
    add_dev_set_arguments(ap)
    a = ap.parse_args(argv)
    make_dev_set(a)
    out, t0 = os.path.abspath(a.out), time.time()
    per_run = {}
    for seed in a.seeds:
        first = None  # the seed's first run: its stage 1 is copied to the others
        for ratio in a.ratios:
            tag = "r" + ratio.replace("/", "_")
            run_dir = os.path.join(out, tag, f"s{seed}")
            os.makedirs(run_dir, exist_ok=True)
            if first is not None:
                share_stage1(first.out, run_dir)
            print(f"\n##### seed {seed}, {tag}: {' '.join(a.methods)} "
                  f"({(time.time() - t0) / 60:.1f} min so far)", flush=True)
            run = run_args(a, "partial", ratio, seed, run_dir, a.methods)
            summary = Pipeline(run).run_all()
            if first is None:
                first = run
            elif split_ids(first.out) != split_ids(run_dir):
                raise SystemExit(f"error: {run_dir}: the stage-1 data differ from {first.out}'s; "
                                 "its copied stage-1 models are not valid here")
            per_run.setdefault(tag, []).append(summary)
        if a.ceiling:
            print(f"\n##### seed {seed}, full: the ceiling ({(time.time() - t0) / 60:.1f} min "
                  "so far)", flush=True)
            per_run.setdefault("full", []).append(
                run_ceiling(first, os.path.join(out, "full", f"s{seed}")))
    baseline = METHODS[a.baseline].label
    lines = [f"Development set {a.root}; seeds {a.seeds}; mean ± std (ddof=1); p: one-tailed "
             f"Welch t-test of the row > {baseline}.", "",
             "| ratio | method | n | AP@IoU0.2 (%) | p | Recall@0.5 FPPI (%) | p |",
             "|---|---|---|---|---|---|---|"]
    grid = {}
    for tag, per_seed in per_run.items():
        rows = ratio_table(per_seed, baseline)
        grid[tag] = rows
        for r in rows:
            cells = []
            for m in METRICS:
                p = r[f"{m}_p"]
                cells += [f"{r[f'{m}_mean']:.1f} ± {r[f'{m}_std']:.1f}",
                          "—" if np.isnan(p) else f"{p:.3f}"]
            lines.append(f"| {tag} | {r['method']} | {r['n']} | " + " | ".join(cells) + " |")
    cam = {tag: [s["cam_quality"] for s in per_seed if s.get("cam_quality")]
           for tag, per_seed in per_run.items()}
    for tag, q in cam.items():
        if q:
            lines.append(f"\n{tag}: GradCAM boxes on D_w hit "
                         f"{100 * np.mean([x['lesion_hit_rate'] for x in q]):.1f}% of lesions, "
                         f"{100 * np.mean([x['box_hit_rate'] for x in q]):.1f}% of boxes on a "
                         "lesion (mean over seeds).")
    md = "\n".join(lines) + f"\n\n{(time.time() - t0) / 60:.1f} min.\n"
    atomic_write_text(os.path.join(out, "grid.md"), md)
    atomic_write_json(os.path.join(out, "grid.json"), {"grid": grid, "cam_quality": cam},
                      indent=1)
    print("\n" + md)


if __name__ == "__main__":
    main()
