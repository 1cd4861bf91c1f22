"""The full-label ceiling of a partially labelled run: Faster R-CNN on every training box.

A table of semi-supervised rows means little without it: it says how far the 1/n rows sit below
what the boxes of every training image would give (issue 27). It is the same split (train_all,
val and test do not depend on the protocol or the ratio: data/protocols.py), the same stage-1
classifier (copied, not retrained) and the fully labelled protocol, under which a source without
weak cases has an empty D_w, so an epoch is a pass over every boxed image (config/schedule.py).
"""
import copy
import json
import os
import shutil

from ..utils.io import atomic_write_json
from .core import Pipeline
from .methods import METHODS, STAGE1
from .results import CEILING

SPLIT_ROLES = ("train_all", "val", "test")


def share_stage1(src, dst):
    """Copy the finished stage-1 folders of the run in ``src`` into the run in ``dst``."""
    for name in STAGE1:
        if os.path.exists(os.path.join(src, name, "stage_done.json")) and \
                not os.path.exists(os.path.join(dst, name)):
            shutil.copytree(os.path.join(src, name), os.path.join(dst, name), symlinks=True)


def split_ids(run_dir, roles=SPLIT_ROLES):
    """{role: image ids} of the split file a run wrote (the first under <run_dir>/splits)."""
    folder = os.path.join(run_dir, "splits")
    name = next(f for f in sorted(os.listdir(folder)) if "_split_" in f)
    with open(os.path.join(folder, name)) as f:
        split = json.load(f)
    return {role: split[role] for role in roles}


def ceiling_args(args, out, epochs=None):
    """The pipeline arguments of the ceiling of the run ``args``: the full protocol, Faster
    R-CNN only, into ``out``; ``epochs`` (passes over every boxed image) when given."""
    a = copy.copy(args)
    a.protocol, a.ratio, a.methods, a.out = "full", "1", ["faster_rcnn"], out
    if epochs is not None:
        a.det_opts = [*args.det_opts, "SOLVER.BRAIXDET.EPOCHS", str(epochs)]
    return a


def run_ceiling(args, out, epochs=None):
    """Train and score the ceiling of the finished run ``args`` in ``out``, from its stage-1
    models; returns that run's summary with the row renamed to ``results.CEILING``. An error
    when the two runs' data differ (the copied classifier would not be this split's)."""
    os.makedirs(out, exist_ok=True)
    share_stage1(args.out, out)
    summary = Pipeline(ceiling_args(args, out, epochs)).run_all()
    if split_ids(args.out) != split_ids(out):
        raise SystemExit(f"error: {out}: its split differs from {args.out}'s, so the copied "
                         "stage-1 models and the test set are not the same run's")
    label = METHODS["faster_rcnn"].label
    summary["results"] = {CEILING: summary["results"][label]}
    summary["row_cpu_seconds"] = {CEILING: summary["row_cpu_seconds"].get(label)}
    return summary


def add_ceiling(args, summary, epochs=None):
    """The ceiling of the finished run ``args`` (in <run>/ceiling) as the last row of that run's
    ``summary`` and its results.json."""
    print(f"\n##### full-label ceiling of {args.out}", flush=True)
    ceiling = run_ceiling(args, os.path.join(args.out, "ceiling"), epochs)
    summary["results"].update(ceiling["results"])
    summary.setdefault("row_cpu_seconds", {}).update(ceiling["row_cpu_seconds"])
    atomic_write_json(os.path.join(args.out, "results.json"), summary, indent=1)


def ceiling_when_ready(args, epochs, stop):
    """run_ceiling of one seed's run once the classifier it starts from is done (or never, when
    ``stop``, a threading.Event, is set first: the grid failed)."""
    marker = os.path.join(args.out, METHODS["faster_rcnn"].init, "stage_done.json")
    while not os.path.exists(marker):
        if stop.wait(2.0):
            return None
    return run_ceiling(args, os.path.join(args.out, "ceiling"), epochs)
