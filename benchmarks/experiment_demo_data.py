#!/usr/bin/env python
"""Which data should the demo show? Candidate generator settings on a development draw.

  python benchmarks/experiment_demo_data.py --out out/demo_data --candidates N H1 H2

docs/RESULTS.md §1.8 (criteria written before any run): each candidate is the demo's generator
call (braixdet/pipeline/demo.py, DEMO["full"]) plus settings of `benchmark_a` (CANDIDATES),
drawn with another generator seed than the demo's. Per candidate, with the demo's configs and
schedules: BRAIxMVCCL's test AUC, 1/8 Faster R-CNN, and the full-label ceiling
(pipeline/ceiling.py) with the iteration its export came from; no semi-supervised row.
Writes <out>/demo_data.md and demo_data.json with the criteria's verdicts. Re-running continues
(done-markers). Not part of `make bench` (about 15 CPU minutes per candidate).
"""
import argparse
import os

import yaml
from experiment_stage1_dev import export_iteration

from braixdet.pipeline.ceiling import run_ceiling
from braixdet.pipeline.core import Pipeline
from braixdet.pipeline.demo import DEMO, make_data, pipeline_args
from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import CEILING, row_metric
from braixdet.utils.io import atomic_write_json, atomic_write_text

DEV_DATA_SEED = 1  # the demo's data are seed 0 (demo.DATA_SEED)
_ANATOMY = dict(texture_strength=0.05, vessels=2.0, vessel_calc_fraction=0.3,
                benign_per_breast=0.6, size_sigma=0.45)  # benchmark_a's (regimes.py)
CANDIDATES = {"N": {}, "H1": _ANATOMY, "H2": dict(_ANATOMY, contrast_scale=0.8)}
CRITERIA = {"stage1_test_auc_min": 0.75, "gap_min": 10.0, "ceiling_max": 90.0}


def export_position(stage_dir):
    """(iteration of the export, MAX_ITER) of a detector stage: the last epoch's evaluation is
    logged at MAX_ITER - 1, the final one (after training) at MAX_ITER."""
    with open(os.path.join(stage_dir, "config.yaml")) as f:  # written with MAX_ITER resolved
        max_iter = yaml.safe_load(f)["SOLVER"]["MAX_ITER"]
    return export_iteration(stage_dir), int(max_iter)


def verdict(r):
    checks = {f"stage-1 test AUC >= {CRITERIA['stage1_test_auc_min']:g}":
              r["mvccl_test_auc"] >= CRITERIA["stage1_test_auc_min"],
              f"ceiling - 1/8 >= {CRITERIA['gap_min']:g}":
              r["ceiling_ap20"] - r["floor_ap20"] >= CRITERIA["gap_min"],
              f"ceiling <= {CRITERIA['ceiling_max']:g}":
              r["ceiling_ap20"] <= CRITERIA["ceiling_max"]}
    return checks, all(checks.values())


def run_candidate(a, name):
    out = os.path.join(a.out, name)
    spec = dict(DEMO["full"], generator=CANDIDATES[name])
    root = os.path.join(out, "data")
    make_data(root, spec, seed=DEV_DATA_SEED)
    args = pipeline_args(root, os.path.join(out, "run"), spec, out, 0, ["faster_rcnn"])
    args.opts = [*args.opts, "NUM_THREADS", str(a.threads)]
    print(f"##### candidate {name}: {CANDIDATES[name] or '(the demo data as is)'}", flush=True)
    pipe = Pipeline(args)
    floor = pipe.run_all()
    ceiling = run_ceiling(args, os.path.join(args.out, "ceiling"), spec["ceiling_epochs"])
    pipe.stage1("mvccl")
    mvccl = pipe.classifier_metrics("mvccl")
    it, last = export_position(os.path.join(args.out, "ceiling", "faster_rcnn"))
    single_view = floor["classifiers"]["classifier_single_view"]
    r = {"candidate": name, "generator": CANDIDATES[name],
         "floor_ap20": row_metric(floor["results"][METHODS["faster_rcnn"].label]),
         "ceiling_ap20": row_metric(ceiling["results"][CEILING]),
         "mvccl_test_auc": float(mvccl["test"]["AUC"]),
         "single_view_test_auc": float(single_view["test"]["AUC"]),
         "ceiling_export_iteration": it, "ceiling_max_iter": last,
         "ceiling_export_in_last_epoch": it >= last - 1}
    r["checks"], r["qualifies"] = verdict(r)
    return r


def table(results):
    lines = ["| candidate | BRAIxMVCCL test AUC | single-view test AUC | 1/8 Faster R-CNN AP@0.2 "
             "| ceiling AP@0.2 | gap | ceiling export iteration (of MAX_ITER) | qualifies |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['candidate']} | {r['mvccl_test_auc']:.3f} | "
                     f"{r['single_view_test_auc']:.3f} | {r['floor_ap20']:.1f} | "
                     f"{r['ceiling_ap20']:.1f} | {r['ceiling_ap20'] - r['floor_ap20']:.1f} | "
                     f"{r['ceiling_export_iteration']} ({r['ceiling_max_iter']}) | "
                     f"{'yes' if r['qualifies'] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every stage")
    a = ap.parse_args(argv)
    a.out = os.path.abspath(a.out)
    results = [run_candidate(a, name) for name in a.candidates]
    atomic_write_json(os.path.join(a.out, "demo_data.json"),
                      {"dev_data_seed": DEV_DATA_SEED, "criteria": CRITERIA, "results": results},
                      indent=1)
    text = table(results)
    atomic_write_text(os.path.join(a.out, "demo_data.md"), text)
    print("\n" + text)


if __name__ == "__main__":
    main()
