"""The README's demo: the whole BRAIxDet method on a synthetic DICOM dataset, on a CPU.

1. writes a synthetic screening dataset in the CBIS-DDSM layout (synthetic_mammo), once
2. the pipeline with the demo configs (configs/demo/: the paper's configs at 256x128, offline
   ImageNet EfficientNet-Lite0, short schedules): BRAIxMVCCL and a single-view classifier;
   Algorithm 1 pseudo-boxes and their hit rate; the rows CAM only, Faster R-CNN, Mean Teacher
   (multi-view SSL without GradCAM) and BRAIxDet at the 1/8 protocol, for each seed, and the
   full-label ceiling (Faster R-CNN on every training box, same split: pipeline/ceiling.py)
3. the table (one seed: its numbers; several: mean ± std over seeds) plus the classifiers' AUC,
   in `out/demo/`: results.md/json, metrics, FROC curves (CSV + PNG) and overlay PNGs.

Stages run ``jobs`` at once as local jobs (pipeline/launcher.py; default one per core, as the
demo configs' ``NUM_THREADS`` is 1), or one after another in this process (``jobs`` 1); each
stage keeps the configs' ``NUM_THREADS``, so the table is the same whatever ``jobs`` is. On two
cores two one-thread stages at once are fastest (docs/RESULTS.md §1.9–§1.11).
"""
import json
import os
import shutil
import time

import numpy as np

from ..config import build_cfg, register_datasets
from ..inference.visualize import dataset_items, load_predictions, render
from ..model_zoo import get_config_file
from ..utils.io import atomic_write_json, atomic_write_text
from .ceiling import add_ceiling
from .core import Pipeline, demo_config_args
from .launcher import local_job_args, run_parallel
from .results import CEILING, format_classifiers, format_table
from .seeds import DEFAULT_METHODS, NOT_RANKED, run_seeds, seed_args, write_experiments

CEILING_ROW = "ceiling"  # the --methods name of the full-label reference row
METHODS = ["cam_only", "faster_rcnn", "mean_teacher", "braixdet", CEILING_ROW]
# several seeds make the paper-style table: every row, the competitors too (about 29 min a
# seed: 87 min for three, docs/RESULTS.md §1.0a)
ALL_METHODS = DEFAULT_METHODS + ["stac", "unbiased_teacher", "soft_teacher", CEILING_ROW]
# synthetic set, canonical input, schedules (stage-1 / stage-2 epochs; the ceiling's in passes
# over every boxed image); docs/RESULTS.md §1.5
DEMO = {
    "full": dict(patients=160, rows=512, cols=320, separation=2.0, size=(256, 128),
                 stage1_epochs=5.0, det_epochs=3.0, ceiling_epochs=3.0),
    "quick": dict(patients=24, rows=256, cols=160, separation=2.0, size=(128, 64),
                  stage1_epochs=2.0, det_epochs=1.0, ceiling_epochs=1.0),
}
DATA_SEED = 0  # one synthetic dataset for every seed: seeds vary the split and the training
CHANCE_AUC = 0.6  # below this the classifier learned nothing: say so next to the table


def stage_threads():
    """The cores a stage uses: NUM_THREADS of the demo configs (configs/demo/Base-*.yaml)."""
    return build_cfg(get_config_file("demo/BRAIxDet/braixdet.yaml"), []).NUM_THREADS


def default_jobs():
    """Stages at once: one per stage_threads() cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return max(1, cores // stage_threads())


def make_data(root, spec, seed=DATA_SEED):
    """Generate the synthetic dataset once; a marker beside it (not inside) records the spec.
    ``spec["generator"]``: further make_synthetic_dataset settings (texture, look-alikes)."""
    marker = root.rstrip("/") + ".json"
    extra = dict(spec.get("generator", {}))
    want = {k: spec[k] for k in ("patients", "rows", "cols", "separation")} | {"seed": seed} \
        | extra
    if os.path.exists(marker):
        with open(marker) as f:
            if json.load(f) == want:
                print(f"=== [data] reusing {root}")
                return
    from synthetic_mammo import make_synthetic_dataset

    shutil.rmtree(root, ignore_errors=True)
    print(f"=== [data] synthetic dataset: {spec['patients']} patients -> {root}", flush=True)
    make_synthetic_dataset(root, patients=spec["patients"], image_size=(spec["rows"], spec["cols"]),
                           lesion_rate=0.7, seed=seed, separation=spec["separation"],
                           progress=True, **extra)
    atomic_write_json(marker, want)


def draw_overlays(out_dir, det_dir, test_name, n=4):
    """GT (blue) and the three best BRAIxDet teacher detections (red) on a few malignant test
    images."""
    det_file = os.path.join(det_dir, "inference", "model", test_name, "detections_coco.json")
    if not os.path.exists(det_file):
        return []
    items = []
    for key, file_name, lat, gt, (boxes, scores) in dataset_items(
            test_name, load_predictions(det_file), only_with_lesions=True)[:n]:
        best = np.argsort(-scores, kind="stable")[:3]
        items.append((key, file_name, lat, gt, (boxes[best], scores[best])))
    return render(items, out_dir)


def report(tables, summary, spec, quick, seeds, minutes, overlays, out):
    h, w = spec["size"]
    seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else \
        f"seeds {', '.join(map(str, seeds))} (mean ± std, ddof=1)"
    lines = [f"# BRAIxDet demo ({'quick' if quick else 'full'})", "",
             f"Synthetic CBIS-DDSM-layout data: {spec['patients']} patients, "
             f"{spec['rows']}x{spec['cols']} DICOMs (lesion separation {spec['separation']}); "
             f"canonical input {h}x{w}; 1/8 partially labelled protocol, {seed_text}; "
             f"{spec['stage1_epochs']:g} stage-1 and {spec['det_epochs']:g} stage-2 epochs on "
             f"CPU; total {minutes:.1f} min.", "", tables, "", NOT_RANKED +
             (" One seed shows no spread: run `tools/run_demo.py --seeds 0 1 2` for it."
              if len(seeds) == 1 else "")]
    if CEILING in tables:
        lines += ["", f"{CEILING}: Faster R-CNN trained on the boxes of every training image "
                  "(the fully labelled protocol; same split, stage 1 and test set), so the 1/8 "
                  "rows can be read between the 1/8 Faster R-CNN row and it."]
    q = summary.get("cam_quality")
    if q:
        lines += ["", f"GradCAM pseudo-boxes on D_w: {100 * q['box_hit_rate']:.1f}% of "
                  f"{q['boxes']} boxes hit a lesion, {100 * q['lesion_hit_rate']:.1f}% of "
                  f"{q['lesions']} lesions hit (IoU >= 0.2)."]
    weak = [n for n, m in summary["classifiers"].items()
            if (m.get("test", {}).get("AUC") or 0.0) < CHANCE_AUC]
    if weak:
        lines += ["", f"**Warning**: test AUC below {CHANCE_AUC} for {', '.join(weak)}: the "
                  "classifier is near chance, so its GradCAM boxes and the detectors it "
                  "initialises carry little signal in this run."]
    lines += ["", "Overlays: " + ", ".join(os.path.relpath(p, out) for p in overlays)]
    return "\n".join(lines) + "\n"


def pipeline_args(root, out, spec, base, seed, methods=METHODS):
    return demo_config_args(root, out, size=spec["size"], stage1_epochs=spec["stage1_epochs"],
                            det_epochs=spec["det_epochs"], seed=seed, methods=methods,
                            cache_dir=os.path.join(base, "cache"))  # survives re-runs


def run_demo(out="out", quick=False, seeds=(0,), resume=False, methods=None, jobs=None):
    """The demo into <out>/demo (or demo_quick); one seed there, several in <out>/demo/s<seed>
    with the mean ± std table. ``methods``: the rows (default: METHODS for one seed,
    ALL_METHODS for several); ``jobs``: stages at once (default: default_jobs()). Returns the
    (first seed's or the seeds') summary."""
    t0 = time.time()
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise SystemExit(f"error: --jobs {jobs}: at least one stage must run")
    seeds = list(seeds)
    one = len(seeds) == 1
    methods = list(methods or (METHODS if one else ALL_METHODS))
    ceiling = CEILING_ROW in methods
    methods = [m for m in methods if m != CEILING_ROW]
    if not methods:
        raise SystemExit(f"error: --methods {CEILING_ROW} needs another row: the ceiling is "
                         "scored on that run's split, from its stage-1 classifier")
    spec = DEMO["quick" if quick else "full"]
    base = os.path.abspath(out)
    out = os.path.join(base, "demo_quick" if quick else "demo")
    if not resume:
        shutil.rmtree(out, ignore_errors=True)
    root = os.path.join(base, "data_quick" if quick else "data")
    make_data(root, spec)
    args = pipeline_args(root, out, spec, base, seeds[0], methods)
    per_seed_out = _same_folder(out) if one else None
    ceiling_epochs = spec["ceiling_epochs"] if ceiling else 0
    if jobs > 1:
        print(f"=== [demo] up to {jobs} stages at once; each stage's full log in "
              f"{out}{'' if one else '/s<seed>'}/logs/", flush=True)
        per_seed = run_parallel(args, seeds, out, local_job_args(jobs, stage_threads(), 0),
                                ceiling_epochs, per_seed_out)
    else:
        per_seed = run_seeds(args, seeds, out, per_seed_out)
    for seed, summary in zip(seeds, per_seed):
        if ceiling:  # trained by run_parallel already: then this reads its finished stages
            add_ceiling(seed_args(args, seed, out, per_seed_out), summary, ceiling_epochs)
    first = Pipeline(args if one else pipeline_args(root, os.path.join(out, f"s{seeds[0]}"),
                                                    spec, base, seeds[0], methods))
    if one:
        summary = per_seed[0]
        tables = (format_table(summary["results"]) + "\n\n"
                  + format_classifiers(summary["classifiers"]))
    else:
        tables, _ = write_experiments(per_seed, seeds, out, (time.time() - t0) / 60)
        summary = per_seed[0]
    overlays = _overlays(first, out)
    text = report(tables, summary, spec, quick, seeds, (time.time() - t0) / 60, overlays, out)
    atomic_write_text(os.path.join(out, "results.md"), text)
    print("\n" + text)
    print(f"outputs in {out}")
    return summary


class _same_folder:
    """per_seed_out of one seed: the demo's folder itself (a class, so local jobs can pickle
    it)."""

    def __init__(self, out):
        self.out = out

    def __call__(self, seed):
        return self.out


def _overlays(pipeline, out):
    # the pipeline's own dataset overrides, so the overlays see the same registered split
    register_datasets(build_cfg(get_config_file("demo/BRAIxDet/braixdet.yaml"),
                                [*pipeline.common, "OUTPUT_DIR",
                                 os.path.join(out, "overlays_tmp")]))
    return draw_overlays(os.path.join(out, "overlays"), pipeline.dir("braixdet"),
                         pipeline.test_name())
