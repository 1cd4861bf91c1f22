#!/usr/bin/env python
"""The paper's Table 6 rows and the competitors on a benchmark regime, paired by seed.

  python benchmarks/experiment_table6.py --regime benchmark_a --out out/table6 --seeds 0 1 2

Issue 27 item 2. Generates the regime (synthetic_mammo.REGIMES with ``--set KEY=VALUE``, as
experiment_benchmark_regime.py) under <out>/data, then per seed one pipeline run with every row
(demo configs at ``--size``) into <out>/r<ratio>/s<seed> and the full-label ceiling
(pipeline/ceiling.py) into <run>/ceiling. Writes <out>/table6.md and table6.json: every row as
mean ± std over seeds; each component's effect (MV, SSL, CAM fusion) paired by seed with its 95%
interval, paired t and Wilcoxon p-values, beside the paper's Table 6 sign; BRAIxDet against every
other row (one-tailed). Re-running continues (done-markers). Hours of CPU per seed at the
paper's image count: run it on a GPU, e.g. ``--set patients=1300 --size 512 256 --opts
MODEL.DEVICE cuda DATALOADER.NUM_WORKERS 4`` (RESULTS §11: stage 1 learns there). Not part
of `make bench`. ``--parallel``: every stage whose inputs are ready runs at once as a local job
(pipeline/launcher.py, as run_experiments.py --launcher local) and each seed's ceiling as soon
as its single-view classifier is done: for one large GPU, which one run leaves mostly idle.
``--no-ceiling`` leaves the ceilings out, so that the rows of a seed can be split across runs
(time-limited GPU leases, moving the done stages' folders to the same path): each run trains
only what is not done, and a last run without it adds the ceilings.
"""
import argparse
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from experiment_benchmark_regime import (
    ROW,
    add_regime_arguments,
    ap20,
    check_means,
    criteria_text,
    make_regime,
    parse_sets,
)
from experiment_ratio_grid import run_args

from braixdet.pipeline.ceiling import add_ceiling, run_ceiling
from braixdet.pipeline.launcher import add_launcher_arguments, launch
from braixdet.pipeline.methods import CAM_ONLY, METHODS
from braixdet.pipeline.results import CEILING, paired_tables, paper_table
from braixdet.pipeline.seeds import DEFAULT_METHODS, run_seeds, seed_args
from braixdet.utils.io import atomic_write_json, atomic_write_text

ROWS = [*DEFAULT_METHODS, "stac", "unbiased_teacher", "soft_teacher"]
CRITERIA_NAME = "Regime criteria (RESULTS §10) on the seeds' means"


def pipeline_args(a):
    """One pipeline run's arguments (its seed and folder are set per seed by run_seeds)."""
    args = run_args(a, "partial", a.ratio, 0, a.run_dir, a.methods)
    args.opts += a.opts
    args.stage1_opts += a.stage1_opts
    args.det_opts += a.det_opts
    return args


def regime_criteria(per_seed):
    """§10's criteria of a regime (experiment_benchmark_regime) on the seeds' mean 1/8 Faster
    R-CNN and ceiling rows, when the table has both; else None."""
    if not all(ROW in s["results"] and CEILING in s["results"] for s in per_seed):
        return None
    return check_means(*([ap20(s, row) for s in per_seed] for row in (ROW, CEILING)))


def ceiling_when_ready(args, epochs, stop):
    """run_ceiling of one seed's run once the classifier it starts from is done (or never, when
    ``stop`` is set first: the grid failed)."""
    marker = os.path.join(args.out, METHODS["faster_rcnn"].init, "stage_done.json")
    while not os.path.exists(marker):
        if stop.wait(2.0):
            return None
    return run_ceiling(args, os.path.join(args.out, "ceiling"), epochs)


def run_parallel(args, seeds, run_dir, ceiling_epochs):
    """The grid's stages as parallel local jobs, each ceiling beside them; the summaries from
    the finished stages (run_seeds reading done-markers, as the launcher's summary job)."""
    jobs = add_launcher_arguments(argparse.ArgumentParser()).parse_args(
        ["--launcher", "local", "--gpus-per-job", "1", "--cpus-per-job", "2"])
    grid = argparse.Namespace(**{**vars(args), **vars(jobs)})
    stop = threading.Event()
    with ThreadPoolExecutor(len(seeds)) as pool:
        ceilings = [pool.submit(ceiling_when_ready, seed_args(args, s, run_dir), ceiling_epochs,
                                stop) for s in seeds if ceiling_epochs]
        try:
            launch(grid, seeds, run_dir)
        finally:
            stop.set()  # a ceiling still waiting for its classifier will not get it
        for c in ceilings:
            c.result()  # its error, if it failed
    return run_seeds(args, seeds, run_dir, job="summary")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_regime_arguments(ap)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--ratio", default="1/8")
    ap.add_argument("--methods", nargs="+", default=ROWS, choices=[CAM_ONLY, *METHODS])
    ap.add_argument("--size", nargs=2, type=int, default=[256, 128])
    ap.add_argument("--stage1-epochs", type=float, default=5.0)
    ap.add_argument("--det-epochs", type=float, default=3.0, help="epochs of D_w")
    ap.add_argument("--ceiling-epochs", type=float, default=8.0,
                    help="passes over every boxed image (RESULTS §10: 8 peaked at the 7th)")
    ap.add_argument("--opts", nargs="*", default=[], help="overrides for every stage")
    ap.add_argument("--stage1-opts", nargs="*", default=[], help="overrides for stage 1")
    ap.add_argument("--det-opts", nargs="*", default=[], help="overrides for the detectors")
    ap.add_argument("--no-ceiling", action="store_true",
                    help="leave the full-label ceiling out (a later run with it trains only it: "
                         "done stages are skipped), e.g. to split a seed across GPU leases")
    ap.add_argument("--parallel", action="store_true",
                    help="every ready stage at once as a local job, the ceilings beside them")
    a = ap.parse_args(argv)
    if a.ceiling_epochs <= 0:
        ap.error("--ceiling-epochs must be > 0 (--no-ceiling leaves the ceiling out)")
    a.out, t0 = os.path.abspath(a.out), time.time()
    a.root, record = make_regime(a.regime, parse_sets(a.set), a.out)
    a.run_dir = os.path.join(a.out, "r" + a.ratio.replace("/", "_"))
    args = pipeline_args(a)
    ceiling_epochs = 0 if a.no_ceiling else a.ceiling_epochs
    per_seed = run_parallel(args, a.seeds, a.run_dir, ceiling_epochs) if a.parallel else \
        run_seeds(args, a.seeds, a.run_dir)
    for seed, summary in zip(a.seeds, per_seed):
        if ceiling_epochs:
            add_ceiling(seed_args(args, seed, a.run_dir), summary, ceiling_epochs)
    rows_md, rows = paper_table(per_seed)
    effects_md, effects = paired_tables(per_seed)
    criteria = regime_criteria(per_seed)
    minutes = (time.time() - t0) / 60
    text = (f"Regime {a.regime} {record['overrides'] or ''}; ratio {a.ratio}; seeds {a.seeds}; "
            f"mean ± std (ddof=1); {minutes:.1f} min.\n\n{rows_md}\n\n{effects_md}\n"
            + (f"\n```\n{criteria_text(CRITERIA_NAME, criteria)}\n```\n" if criteria else ""))
    atomic_write_text(os.path.join(a.out, "table6.md"), text)
    atomic_write_json(os.path.join(a.out, "table6.json"),
                      {"regime": record, "seeds": a.seeds, "ratio": a.ratio, "rows": rows,
                       "effects": effects, "per_seed": [s["results"] for s in per_seed],
                       "criteria": criteria,
                       "minutes": round(minutes, 1)}, indent=1)
    print("\n" + text)


if __name__ == "__main__":
    main()
