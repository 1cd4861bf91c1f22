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
only what is not done, and a last run without it adds the ceilings. ``--record FILE`` keeps
the finished rows where a fresh machine finds them (a JSON file in the repository, e.g.
docs/results/): each run adds its seeds' rows to it, refuses a record of other settings, and the
tables are computed over every seed and row the record holds, so that rows trained in separate
sessions, on CPU or GPU leases, are paired by seed. <out>/table6.png (and FILE's name with .png
beside a record) draws each detector row's test AP@0.2 per seed against the ceiling.
"""
import argparse
import json
import os
import time

import torch
from _common import cpu_model, plot_rows
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
from filelock import FileLock

from braixdet.pipeline.ceiling import add_ceiling
from braixdet.pipeline.launcher import local_job_args, run_parallel
from braixdet.pipeline.methods import CAM_ONLY, METHODS
from braixdet.pipeline.results import CEILING, paired_tables, paper_table, row_metric
from braixdet.pipeline.seeds import DEFAULT_METHODS, run_seeds, seed_args
from braixdet.utils.io import atomic_write_bytes, atomic_write_json, atomic_write_text

ROWS = [*DEFAULT_METHODS, "stac", "unbiased_teacher", "soft_teacher"]
CRITERIA_NAME = "Regime criteria (RESULTS §10) on the seeds' means"
# --opts keys that say where a run executes, not what it trains: rows run with other values
# still belong to one record (each row keeps its own values beside its machine). How often a
# run is checkpointed is one of them: a run resumed from any checkpoint ends with the weights
# of one never checkpointed (tests/test_reliability.py), so a CPU row split across sessions
# can bank its progress more often than once an epoch.
EXECUTION_KEYS = ("MODEL.DEVICE", "DATALOADER.NUM_WORKERS", "NUM_THREADS",
                  "SOLVER.CHECKPOINT_PERIOD")
# what a seed's summary carries into the record besides its rows (first run's value is kept)
SEED_FIELDS = ("cam_quality", "protocol")


def pipeline_args(a):
    """One pipeline run's arguments (its seed and folder are set per seed by run_seeds)."""
    args = run_args(a, "partial", a.ratio, 0, a.run_dir, a.methods)
    args.opts += a.opts
    args.stage1_opts += a.stage1_opts
    args.det_opts += a.det_opts
    return args


def opt_pairs(opts):
    return list(zip(opts[::2], opts[1::2]))


def setting_opts(opts):
    """A KEY VALUE list without the execution keys: how a run executed is not a setting."""
    return [x for kv in opt_pairs(opts) if kv[0] not in EXECUTION_KEYS for x in kv]


def cam_fusion_window(a):
    """Algorithm 2's GradCAM fusion window of the detectors, in epochs of D_w, as the runs get
    it (the paper's share of --det-epochs unless --det-opts sets SSL.CAM_FUSION_EPOCHS)."""
    return float(dict(opt_pairs(pipeline_args(a).det_opts))["SSL.CAM_FUSION_EPOCHS"])


def record_settings(a, regime):
    """What a record's rows must share: the regime and every training setting, the fusion
    window included (rows of another window are other rows: RESULTS §22, 2026-12-01)."""
    return json.loads(json.dumps({
        "regime": regime, "ratio": a.ratio, "size": a.size, "stage1_epochs": a.stage1_epochs,
        "det_epochs": a.det_epochs, "cam_fusion_epochs": cam_fusion_window(a),
        "ceiling_epochs": a.ceiling_epochs,
        "opts": opt_pairs(setting_opts(a.opts)),
        "stage1_opts": setting_opts(a.stage1_opts), "det_opts": setting_opts(a.det_opts)}))


def machine(opts):
    """The device the rows trained on, in words (the GPU's name or the CPU model)."""
    device = dict(opt_pairs(opts)).get("MODEL.DEVICE", "cpu")
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{cpu_model()} ({os.cpu_count()} cores)"


def load_record(path, settings):
    """The record at ``path`` (empty when missing); refuses one of other settings."""
    if not os.path.exists(path):
        return {"settings": settings, "seeds": {}}
    with open(path) as f:
        record = json.load(f)
    if record.get("settings") != settings:
        raise SystemExit(f"error: {path} records rows of other settings than this run's "
                         "(its 'settings'); use another --record")
    return record


def started_from(label, summary):
    """The stage-1 classifier a row started from and its test AUC in this run: rows of one seed
    from other runs may start from other exports of it (RESULTS §22, 2026-12-03)."""
    inits = {m.label: m.init for m in METHODS.values()}
    inits[CEILING] = METHODS["faster_rcnn"].init  # the ceiling copies the run's classifier
    name = inits.get(label, "mvccl")  # the CAM-only rows score BRAIxMVCCL's maps
    test = ((summary.get("classifiers") or {}).get(name) or {}).get("test") or {}
    return {"stage1": {"classifier": name, "test_AUC": test["AUC"]}} if "AUC" in test else {}


def update_record(path, settings, seeds, per_seed, run):
    """Adds each seed's rows to the record at ``path`` and returns its seeds' summaries, sorted
    by seed. A row already recorded keeps its recorded value (this run's is printed beside it
    when they differ): remove it from the file to replace it. Runs of one record may end at
    once (rows of a seed trained side by side): the read-add-write holds ``<path>.lock``."""
    with FileLock(path + ".lock"):
        return _update_record(path, settings, seeds, per_seed, run)


def _update_record(path, settings, seeds, per_seed, run):
    record = load_record(path, settings)
    for seed, summary in zip(seeds, per_seed):
        entry = record["seeds"].setdefault(str(seed), {"results": {}, "row_cpu_seconds": {},
                                                       "runs": {}})
        for field in SEED_FIELDS:
            if summary.get(field) and not entry.get(field):
                entry[field] = summary[field]
        # per classifier: a seed's rows are split across runs that train different stage 1s
        for name, metrics in (summary.get("classifiers") or {}).items():
            entry.setdefault("classifiers", {}).setdefault(name, metrics)
        for label, metrics in summary["results"].items():
            metrics = json.loads(json.dumps(metrics))
            old = entry["results"].setdefault(label, metrics)
            if old != metrics:
                print(f"seed {seed} {label}: recorded AP@0.2 {row_metric(old):.2f} "
                      f"({entry['runs'][label]['machine']}), this run {row_metric(metrics):.2f} "
                      f"({run['machine']}); the recorded row is kept", flush=True)
                continue
            entry["runs"].setdefault(label, {**run, **started_from(label, summary)})
            seconds = (summary.get("row_cpu_seconds") or {}).get(label)
            entry["row_cpu_seconds"].setdefault(label, seconds)
    atomic_write_json(path, record, indent=1)
    return [record["seeds"][s] for s in sorted(record["seeds"], key=int)]


def regime_criteria(per_seed):
    """§10's criteria of a regime (experiment_benchmark_regime) on the seeds' mean 1/8 Faster
    R-CNN and ceiling rows, when the table has both; else None."""
    if not all(ROW in s["results"] and CEILING in s["results"] for s in per_seed):
        return None
    return check_means(*([ap20(s, row) for s in per_seed] for row in (ROW, CEILING)))


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
    ap.add_argument("--record", default="",
                    help="JSON file the finished rows are added to, per seed; the tables are "
                         "over every row it holds (rows split across sessions and machines)")
    ap.add_argument("--parallel", action="store_true",
                    help="every ready stage at once as a local job, the ceilings beside them")
    a = ap.parse_args(argv)
    if a.ceiling_epochs <= 0:
        ap.error("--ceiling-epochs must be > 0 (--no-ceiling leaves the ceiling out)")
    a.out, t0 = os.path.abspath(a.out), time.time()
    a.root, record = make_regime(a.regime, parse_sets(a.set), a.out)
    a.run_dir = os.path.join(a.out, "r" + a.ratio.replace("/", "_"))
    if a.record:  # refuse a record of other settings before hours of training
        load_record(a.record, record_settings(a, record))
    args = pipeline_args(a)
    ceiling_epochs = 0 if a.no_ceiling else a.ceiling_epochs
    per_seed = run_parallel(args, a.seeds, a.run_dir, local_job_args(), ceiling_epochs) \
        if a.parallel else run_seeds(args, a.seeds, a.run_dir)
    for seed, summary in zip(a.seeds, per_seed):
        if ceiling_epochs:
            add_ceiling(seed_args(args, seed, a.run_dir), summary, ceiling_epochs)
    seeds = a.seeds
    if a.record:
        run = {"machine": machine(a.opts), "opts": a.opts,
               "recorded": time.strftime("%Y-%m-%d", time.gmtime())}
        per_seed = update_record(a.record, record_settings(a, record), a.seeds, per_seed, run)
        seeds = [s["protocol"]["seed"] for s in per_seed]
    rows_md, rows = paper_table(per_seed)
    effects_md, effects = paired_tables(per_seed)
    criteria = regime_criteria(per_seed)
    minutes = (time.time() - t0) / 60
    text = (f"Regime {a.regime} {record['overrides'] or ''}; ratio {a.ratio}; seeds {seeds}; "
            f"mean ± std (ddof=1); {minutes:.1f} min.\n\n{rows_md}\n\n{effects_md}\n"
            + (f"\n```\n{criteria_text(CRITERIA_NAME, criteria)}\n```\n" if criteria else ""))
    atomic_write_text(os.path.join(a.out, "table6.md"), text)
    plotted = [k for k in ROWS if k != CAM_ONLY
               and any(METHODS[k].label in s["results"] for s in per_seed)]
    if plotted:
        png = plot_rows(per_seed, seeds, os.path.join(a.out, "table6.png"), plotted)
        if a.record:  # the same picture beside the record, drawn once
            with open(png, "rb") as f:
                atomic_write_bytes(os.path.splitext(a.record)[0] + ".png", f.read())
    atomic_write_json(os.path.join(a.out, "table6.json"),
                      {"regime": record, "seeds": seeds, "ratio": a.ratio, "rows": rows,
                       "effects": effects, "per_seed": [s["results"] for s in per_seed],
                       "criteria": criteria,
                       "minutes": round(minutes, 1)}, indent=1)
    print("\n" + text)


if __name__ == "__main__":
    main()
