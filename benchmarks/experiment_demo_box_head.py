#!/usr/bin/env python
"""Does a narrower box head cost the demo's supervised rows anything? On a development draw.

  python benchmarks/experiment_demo_box_head.py --out out/box_head --seeds 0 1 2

docs/RESULTS.md §1.11 (criteria written before any run): the box head's two fully connected
layers (MODEL.ROI_BOX_HEAD.FC_DIM, torchvision's and detectron2's 1024) are about a fifth of the
demo's detector step on a CPU. Per split seed, on the demo's data drawn with another generator
seed (experiment_demo_data.DEV_DATA_SEED) and the demo's configs and schedules, 1/8 Faster R-CNN
and the full-label ceiling (pipeline/ceiling.py) with each ``--fc-dims`` value, one single-view
classifier shared by them. Writes <out>/box_head.md and box_head.json: every row's test
AP@0.2 per seed and each value's paired difference from the first, mean and per seed, against
the criterion. Re-running continues (done-markers): seeds can run as separate processes into one
``--out`` and a last run with every seed writes the table. Not part of `make bench` (about 12
CPU minutes per seed and value).
"""
import argparse
import json
import os

import numpy as np
from experiment_demo_data import DEV_DATA_SEED

from braixdet.pipeline.ceiling import run_ceiling, share_stage1
from braixdet.pipeline.core import Pipeline
from braixdet.pipeline.demo import DEMO, make_data, pipeline_args
from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import CEILING, row_metric
from braixdet.utils.io import atomic_write_json, atomic_write_text

ROWS = {"floor": METHODS["faster_rcnn"].label, "ceiling": CEILING}
MAX_LOSS = 3.0  # AP@0.2: a narrower head may cost no row more than this, mean over seeds


def run_seed(a, seed, root):
    """{fc_dim: {row: test AP@0.2}} of one split seed; the first value trains the classifier."""
    done = os.path.join(a.out, f"s{seed}.json")
    if os.path.exists(done):
        with open(done) as f:
            rows = {int(k): v for k, v in json.load(f).items()}
        if set(a.fc_dims) <= set(rows):
            return rows
        raise SystemExit(f"error: {done} holds FC_DIM {sorted(rows)}, not every one of "
                         f"{a.fc_dims}; use another --out")
    spec = DEMO["full"]
    rows, first = {}, None
    for dim in a.fc_dims:
        out = os.path.join(a.out, f"s{seed}", f"fc{dim}")
        args = pipeline_args(root, out, spec, a.out, seed, ["faster_rcnn"])
        args.opts = [*args.opts, "NUM_THREADS", str(a.threads)]
        args.det_opts = [*args.det_opts, "MODEL.ROI_BOX_HEAD.FC_DIM", str(dim)]
        if first is not None:
            os.makedirs(out, exist_ok=True)
            share_stage1(first, out)
        print(f"##### seed {seed}, FC_DIM {dim}", flush=True)
        floor = Pipeline(args).run_all()
        ceiling = run_ceiling(args, os.path.join(out, "ceiling"), spec["ceiling_epochs"])
        rows[dim] = {"floor": row_metric(floor["results"][ROWS["floor"]]),
                     "ceiling": row_metric(ceiling["results"][CEILING])}
        first = first or out
    atomic_write_json(done, rows, indent=1)
    return rows


def table(per_seed, dims):
    seeds = sorted(per_seed)
    lines = ["| row | FC_DIM | " + " | ".join(f"seed {s}" for s in seeds)
             + f" | mean | paired difference from {dims[0]}: mean (per seed) |",
             "|---|---|" + "---|" * len(seeds) + "---|---|"]
    verdicts = {}
    for row, label in ROWS.items():
        for dim in dims:
            ap = [per_seed[s][dim][row] for s in seeds]
            diff = ""
            if dim != dims[0]:
                d = [per_seed[s][dim][row] - per_seed[s][dims[0]][row] for s in seeds]
                verdicts[(row, dim)] = float(np.mean(d)) >= -MAX_LOSS
                diff = f"{np.mean(d):+.1f} ({', '.join(f'{x:+.1f}' for x in d)})"
            lines.append(f"| {label} | {dim} | " + " | ".join(f"{x:.1f}" for x in ap)
                         + f" | {np.mean(ap):.1f} | {diff} |")
    met = {d: all(v for (_, dd), v in verdicts.items() if dd == d) for d in dims[1:]}
    lines += ["", f"Criterion (mean paired difference >= -{MAX_LOSS:g} AP@0.2 for every row): "
              + ", ".join(f"FC_DIM {d}: {'met' if ok else 'not met'}" for d, ok in met.items())]
    return "\n".join(lines) + "\n", verdicts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--fc-dims", nargs="+", type=int, default=[1024, 256],
                    help="MODEL.ROI_BOX_HEAD.FC_DIM values; the first is the reference")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every stage")
    a = ap.parse_args(argv)
    a.out = os.path.abspath(a.out)
    root = os.path.join(a.out, "data")
    make_data(root, DEMO["full"], seed=DEV_DATA_SEED)
    per_seed = {s: run_seed(a, s, root) for s in a.seeds}
    text, verdicts = table(per_seed, a.fc_dims)
    atomic_write_json(os.path.join(a.out, "box_head.json"),
                      {"dev_data_seed": DEV_DATA_SEED, "max_loss": MAX_LOSS,
                       "per_seed": per_seed, "fc_dims": a.fc_dims,
                       "verdicts": {f"{r}/{d}": v for (r, d), v in verdicts.items()}}, indent=1)
    atomic_write_text(os.path.join(a.out, "box_head.md"), text)
    print("\n" + text)


if __name__ == "__main__":
    main()
