#!/usr/bin/env python
"""Does stage 1 (BRAIxMVCCL) learn on hard data? Candidates on a development set, per epoch.

  python benchmarks/experiment_stage1_dev.py --out out/dev_d --candidates A B

Development set D of docs/RESULTS.md §11: `benchmark_a`'s generator settings with another draw
(300 patients, generator seed 2727), protocol partial 1/8, protocol seed 0. ``--regime`` and
``--set`` name another draw instead, e.g. ``--set patients=1300`` for the benchmark's own data:
to measure what a candidate chosen on set D learns there (RESULTS §34), never to choose one.
Each candidate is one set of stage-1 overrides of the demo config
(CANDIDATES below). For each: BRAIxMVCCL trained as the pipeline trains it (its stage-1 stage,
checkpoint every epoch), then every epoch's checkpoint and the export scored with
``--eval-only`` on the validation and the classifier test split, so the export's choice can be
judged against what was available. Writes <out>/stage1_dev.md and stage1_dev.json with the
criteria of §11 (written before any run): stage 1 learns when its export has a validation BCE
below chance (0.693) and a test AUC >= 0.75. Re-running continues (done-markers, finished
evaluations are read back). Not part of `make bench` (CPU hours).
"""
import argparse
import glob
import json
import math
import os

from experiment_benchmark_regime import make_regime, parse_sets
from experiment_ratio_grid import run_args

from braixdet.engine.hooks import read_export_selection
from braixdet.pipeline.core import Pipeline
from braixdet.pipeline.results import read_cam_quality
from braixdet.pipeline.stages import done_marker, read_json, run_stage
from braixdet.utils.checkpoint import safe_torch_load
from braixdet.utils.io import atomic_write_json, atomic_write_text

DEV_SET = {"patients": 300, "seed": 2727}  # benchmark_a's settings, another generator draw
CHANCE_BCE = math.log(2)
LEARNS = {"val_bce_max": CHANCE_BCE, "test_auc_min": 0.75}
# one override set each, everything else as configs/demo/MVCCL/mvccl.yaml (RESULTS §11)
CANDIDATES = {
    "A": [],  # as is (256x128): the "before"
    # the film's own pixels; 2 epochs (CPU time: the §11 amendment), compared with A's first 2
    "B": ["INPUT.BRAIXDET.CANONICAL_SIZE", "(512, 256)", "SOLVER.BRAIXDET.EPOCHS", "2.0"],
    # B for A's 5 epochs (§11, second amendment): is the film's resolution all of the cause?
    "B5": ["INPUT.BRAIXDET.CANONICAL_SIZE", "(512, 256)", "SOLVER.BRAIXDET.EPOCHS", "5.0"],
    # third amendment: at A's 256x128, one suspect each (is a part of BRAIxMVCCL the cause?)
    # single view: no LCM, no GCM (so the LCM widths of mvccl.yaml go back to the defaults:
    # training refuses LCM keys a model does not build; RESULTS §11 trained the same model)
    "SV": ["MODEL.BRAIXDET.MULTI_VIEW", "False", "MODEL.BRAIXDET.LCM.EMBED_DIM", "128",
           "MODEL.BRAIXDET.LCM.OUT_DIM", "128"],
    "GCM0": ["MODEL.BRAIXDET.GCM.LOSS_WEIGHT", "0.0"],  # no consistency loss
    "REG": ["MODEL.BRAIXDET.CLS_DROPOUT", "0.5", "MODEL.BRAIXDET.LCM.DROPOUT", "0.1",
            "INPUT.BRAIXDET.AUG.BRIGHTNESS", "0.3", "INPUT.BRAIXDET.AUG.CONTRAST", "0.3"],
    "LR": ["SOLVER.BASE_LR", "0.00005"],  # a quarter of the demo's 2e-4 (paper 1e-4)
    # B5 at the paper's stage-1 learning rate (paper §4.3: 1e-4; the demo's 2e-4 is a departure
    # for speed), its first 3 epochs: the plateau rule (patience 2) cannot cut before epoch 4
    # (RESULTS §36)
    "BP3": ["INPUT.BRAIXDET.CANONICAL_SIZE", "(512, 256)", "SOLVER.BRAIXDET.EPOCHS", "3.0",
            "SOLVER.BASE_LR", "0.0001"],
    # BP3 for the benchmark's 5 epochs (RESULTS §36, amendment): B5 at the paper's rate
    "BP5": ["INPUT.BRAIXDET.CANONICAL_SIZE", "(512, 256)", "SOLVER.BRAIXDET.EPOCHS", "5.0",
            "SOLVER.BASE_LR", "0.0001"],
}


def scored(pipe, stage_dir, weights, out, opts):
    """{"val": {...}, "test": {...}} of ``weights`` by ``train_net --eval-only`` into ``out``."""
    names = pipe.names()
    files = {split: os.path.join(out, "inference", "model", ds, "classification_metrics.json")
             for split, ds in (("val", names["val"]), ("test", names["test_cls"]))}
    if not all(os.path.exists(f) for f in files.values()):
        run_stage(f"eval {os.path.basename(out)}",
                  [*pipe.tool("train_net"), "--config-file", pipe.config("MVCCL/mvccl.yaml"),
                   "--eval-only", *pipe.common, *opts, "MODEL.WEIGHTS", weights,
                   "OUTPUT_DIR", out], os.path.join(stage_dir, "logs", "eval.log"))
    result = {}
    for split, path in files.items():
        with open(path) as f:
            result[split] = json.load(f)["classification"]
    return result


def draw_settings(a):
    """The generator overrides of the draw: --set's, else set D's (with --patients)."""
    if a.set:
        return parse_sets(a.set)
    return dict(DEV_SET, patients=a.patients or DEV_SET["patients"])


def learns(export):
    """§11's criterion on the export: validation BCE below chance and test AUC >= 0.75."""
    return (export["val"]["BCE"] < LEARNS["val_bce_max"]
            and export["test"]["AUC"] >= LEARNS["test_auc_min"])


def export_iteration(stage_dir):
    """The iteration the trainer exported, as its export file records it (engine/hooks.py)."""
    return read_export_selection(os.path.join(stage_dir, "model_export.pth"))["iteration"]


def run_candidate(a, name):
    out = os.path.join(a.out, name)
    os.makedirs(out, exist_ok=True)
    args = run_args(a, "partial", a.ratio, a.seed, out, ["cam_only"])
    opts = CANDIDATES[name]
    # 1 thread as §9 (runs beside other jobs on 2 cores); --opts last, so it can override
    args.opts = [*args.opts, "NUM_THREADS", "1", *a.opts]
    # every epoch's checkpoint is scored below, so keep them all
    args.stage1_opts = [*args.stage1_opts, *opts, "SOLVER.BRAIXDET.CHECKPOINTS_KEPT", "0"]
    pipe = Pipeline(args)
    print(f"##### candidate {name}: {' '.join(opts) or '(demo config as is)'}", flush=True)
    stage = pipe.train("mvccl", pipe.config("MVCCL/mvccl.yaml"), args.stage1_opts)
    marker = read_json(done_marker(stage))  # the run times of the run that trained it
    epochs = []
    by_iteration = {}  # the last epoch's periodic checkpoint and model_final are one model
    for ckpt in [*sorted(glob.glob(os.path.join(stage, "model_[0-9]*.pth"))),
                 os.path.join(stage, "model_final.pth")]:
        # the storage's (0-based) iteration, as the export's log line names it
        by_iteration.setdefault(int(safe_torch_load(ckpt)["iteration"]), ckpt)
    for it, ckpt in sorted(by_iteration.items()):
        m = scored(pipe, out, ckpt, os.path.join(out, "eval", f"iter{it}"), args.stage1_opts)
        epochs.append({"iteration": it, **{f"{s}_{k}": m[s][k] for s in m for k in ("AUC", "BCE")}})
        print(f"  iteration {it}: val AUC {m['val']['AUC']:.3f} BCE {m['val']['BCE']:.3f}, "
              f"test AUC {m['test']['AUC']:.3f}", flush=True)
    export = scored(pipe, out, os.path.join(stage, "model_export.pth"),
                    os.path.join(out, "eval", "export"), args.stage1_opts)
    it = export_iteration(stage)
    ranks = sorted((e["test_AUC"] for e in epochs), reverse=True)
    # Algorithm 1 from the export (the pipeline's own stage): its boxes on D_w against the
    # withheld truth, box precision and lesion recall at IoU >= 0.2
    cam = read_cam_quality(pipe.gradcam(pipe.stage1("mvccl"))) if a.gradcam else None
    return {"candidate": name, "opts": opts, "epochs": epochs, "export_iteration": it,
            "cam_quality": cam,
            "export": export, "learns": learns(export),
            "train_minutes": round(marker["seconds"] / 60, 1),
            "train_cpu_minutes": round(marker["cpu_seconds"] / 60, 1),
            "export_test_auc_rank": 1 + ranks.index(export["test"]["AUC"])
            if export["test"]["AUC"] in ranks else None}


def table(results):
    lines = ["| candidate | iteration | val AUC | val BCE | test AUC | test BCE |",
             "|---|---|---|---|---|---|"]
    for r in results:
        for e in r["epochs"]:
            mark = " (export)" if e["iteration"] == r["export_iteration"] else ""
            lines.append(f"| {r['candidate']} | {e['iteration']}{mark} | {e['val_AUC']:.3f} | "
                         f"{e['val_BCE']:.3f} | {e['test_AUC']:.3f} | {e['test_BCE']:.3f} |")
    lines += ["", "| candidate | export iteration | val BCE | test AUC | rank of its test AUC "
              "among the epochs | learns (val BCE < 0.693, test AUC >= 0.75) | "
              "train min (CPU min) |",
              "|---|---|---|---|---|---|---|"]
    for r in results:
        ex = r["export"]
        lines.append(f"| {r['candidate']} | {r['export_iteration']} | {ex['val']['BCE']:.3f} | "
                     f"{ex['test']['AUC']:.3f} | {r['export_test_auc_rank']} of "
                     f"{len(r['epochs'])} | {'yes' if r['learns'] else 'no'} | "
                     f"{r['train_minutes']} ({r['train_cpu_minutes']}) |")
    cams = [r for r in results if r.get("cam_quality")]
    if cams:
        lines += ["", "| candidate | Algorithm 1 on D_w: boxes on a lesion (precision) | lesions "
                  "hit (recall) |", "|---|---|---|"]
        for r in cams:
            q = r["cam_quality"]
            lines.append(f"| {r['candidate']} | {100 * q['box_hit_rate']:.1f}% of {q['boxes']} | "
                         f"{100 * q['lesion_hit_rate']:.1f}% of {q['lesions']} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--candidates", nargs="+", default=list(CANDIDATES), choices=CANDIDATES)
    ap.add_argument("--seed", type=int, default=0, help="protocol / training seed")
    ap.add_argument("--ratio", default="1/8")
    ap.add_argument("--size", nargs=2, type=int, default=[256, 128])
    ap.add_argument("--stage1-epochs", type=float, default=5.0)
    ap.add_argument("--patients", type=int,
                    help="patients of the development set's draw (set D: 300)")
    ap.add_argument("--regime", default="benchmark_a",
                    help="the synthetic_mammo.REGIMES key whose settings the draw uses (set D: "
                         "benchmark_a; without --set, set D's seed and size)")
    ap.add_argument("--set", nargs="+", metavar="KEY=VALUE",
                    help="the draw's generator settings instead of set D's (patients=1300: "
                         "the regime's own draw at the paper's image count)")
    ap.add_argument("--gradcam", action="store_true",
                    help="also Algorithm 1 from each export: box precision and lesion recall "
                         "on D_w")
    ap.add_argument("--opts", nargs="*", default=[], metavar="KEY VALUE",
                    help="config overrides for every run, e.g. MODEL.DEVICE cuda "
                         "DATALOADER.NUM_WORKERS 8 NUM_THREADS 4 on a GPU machine")
    a = ap.parse_args(argv)
    a.out = os.path.abspath(a.out)
    a.det_epochs = 3.0  # run_args needs it; no detector runs here
    if a.set and a.patients:
        ap.error("--patients is set D's; with --set, give patients=N there")
    a.root, record = make_regime(a.regime, draw_settings(a), a.out)
    results = [run_candidate(a, name) for name in a.candidates]
    atomic_write_json(os.path.join(a.out, "stage1_dev.json"),
                      {"dev_set": record, "criteria": LEARNS, "results": results}, indent=1)
    text = table(results)
    atomic_write_text(os.path.join(a.out, "stage1_dev.md"), text)
    print("\n" + text)


if __name__ == "__main__":
    main()
