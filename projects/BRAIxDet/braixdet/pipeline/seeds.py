"""Several seeds of the pipeline on one dataset, ending in the paper-style table.

Per seed, one Pipeline run with every method into <out>/s<seed>/ (its own split and stage-1
models). Then, as in the paper's tables: mean ± std (ddof=1) over seeds of AP@0.2 and
Recall@0.5 FPPI per row, the stage-1 classifiers' AUC, and the one-tailed Welch t-test of
BRAIxDet against the second best row. Written to <out>/summary.md and summary.json.
The command line is experiments.py; the cluster launcher (launcher.py) runs these jobs.
"""
import copy
import os
import time

from ..utils.io import atomic_write_bytes, atomic_write_json
from .core import Pipeline
from .results import paper_table

# the rows of the paper's Table 6
DEFAULT_METHODS = ["cam_only", "faster_rcnn", "faster_rcnn_mv", "ssl_single_view",
                   "mean_teacher", "braixdet"]
NOT_RANKED = ("Rows whose means differ by less than their seed spread (std) are not ranked: "
              "the difference is within noise.")


def seed_args(args, seed, out, per_seed_out=None):
    """The pipeline arguments of one seed (its own split, stage 1 and folder: per_seed_out(seed),
    default <out>/s<seed>)."""
    a = copy.copy(args)
    a.seed = seed
    a.out = per_seed_out(seed) if per_seed_out is not None else os.path.join(out, f"s{seed}")
    return a


def run_seeds(args, seeds, out, per_seed_out=None, job=None):
    """Pipeline runs of ``args`` for each seed -> [summary]; per_seed_out(seed) names the
    folder of a seed (default <out>/s<seed>); ``job="summary"``: read finished stages only
    (the cluster launcher's summary job, launcher.py)."""
    per_seed = []
    t0 = time.time()
    for i, seed in enumerate(seeds):
        print(f"\n##### seed {seed} ({i + 1}/{len(seeds)}), "
              f"{(time.time() - t0) / 60:.1f} min so far", flush=True)
        per_seed.append(Pipeline(seed_args(args, seed, out, per_seed_out), job=job).run_all())
    return per_seed


def write_experiments(per_seed, seeds, out, minutes):
    """<out>/summary.md and summary.json of the seed runs; returns (markdown, summary)."""
    md, summary = paper_table(per_seed)
    summary["minutes"] = round(minutes, 1)
    os.makedirs(out, exist_ok=True)
    atomic_write_bytes(os.path.join(out, "summary.md"), (
        md + f"\n\nSeeds {list(seeds)}; mean ± std (ddof=1). {NOT_RANKED}\n").encode())
    atomic_write_json(os.path.join(out, "summary.json"), summary, indent=1)
    return md, summary


def run_experiments(args, seeds, out, job=None):
    """The whole grid: run_seeds then write_experiments; returns the summary dict."""
    out = os.path.abspath(out)
    t0 = time.time()
    per_seed = run_seeds(args, seeds, out, job=job)
    md, summary = write_experiments(per_seed, seeds, out, (time.time() - t0) / 60)
    print("\n" + md)
    print(f"\nwrote {out}/summary.md and summary.json ({summary['minutes']} min)")
    return summary
