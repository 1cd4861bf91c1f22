#!/usr/bin/env python
"""The two-stage BRAIxDet pipeline on one dataset and seed, each stage skipped when done.

  python tools/run_pipeline.py --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --num-gpus 8 --out output/cbis_r1_8_s0 [--methods cam_only faster_rcnn braixdet ...]

Stages (each also runnable alone with tools/train_net.py / tools/gradcam_pseudo_labels.py):
  mvccl                 BRAIxMVCCL classifier pre-training (D_s ∪ D_w, labels only)
  classifier_single_view  single-view EfficientNet classifier, same data (baseline init)
  gradcam               Algorithm 1 pseudo-boxes of the weak cancers (+ their hit rate)
  one folder per method (METHODS): the detector, its exported model (best on validation) and
                        its test metrics (AP@0.2, FROC)
Every row of the paper's ablation (Table 5) is a method; stage-1 models are trained once and
shared by the rows that need them, as in the paper. A killed pipeline re-run continues:
finished stages are skipped and training stages resume from their last checkpoint.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
# lines worth showing while a stage runs: training progress, results, reports, problems
PROGRESS = re.compile(r"eta: |copypaste: \S|Split \(|bad inputs:|wrote |Error|error:|"
                      r"Initialised from|GradCAM fusion|pseudo-box quality|Schedule:|"
                      r"Exported model|Overall training speed")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOG_PREFIX = re.compile(r"^\[\d+/\d+ [\d:]+ [\w.]+\]:\s*")  # detectron2's "[date name]: "
EXPORT = "model_export.pth"  # engine/trainers.py EXPORT_NAME (not imported: no torch here)


@dataclass(frozen=True)
class Method:
    label: str  # the row of the results table
    config: str  # relative to the config root (configs/ or configs/demo/)
    init: str  # the stage-1 model it starts from: "mvccl" | "classifier_single_view"
    cam: bool = False  # reads the GradCAM pseudo-boxes (Algorithm 2)


STAGE1 = {"mvccl": "MVCCL/mvccl.yaml",
          "classifier_single_view": "MVCCL/single_view_classifier.yaml"}
# paper Table 5 rows; "cam_only" (row 1) scores the GradCAM boxes themselves
METHODS = {
    "faster_rcnn": Method("Faster R-CNN", "baselines/faster_rcnn.yaml",
                          "classifier_single_view"),
    "faster_rcnn_mv": Method("Faster R-CNN + MV", "baselines/faster_rcnn_multiview.yaml",
                             "mvccl"),
    "ssl_single_view": Method("SSL (single view)", "baselines/ssl_single_view.yaml",
                              "classifier_single_view"),
    "mean_teacher": Method("MV + SSL (Mean Teacher)", "baselines/mean_teacher_multiview.yaml",
                           "mvccl"),
    "braixdet": Method("BRAIxDet", "BRAIxDet/braixdet.yaml", "mvccl", cam=True),
}
CAM_ONLY = "cam_only"
PAPER_CAM = ("gradcam", "res5")
# README "GradCAM pseudo-boxes": localised the lesions where GradCAM res5 did not
LOCALISING_CAM = ("layercam", "res4")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--dataset", default="cbis_ddsm",
                    choices=["cbis_ddsm", "vindr_mammo", "exam_csv"])
    ap.add_argument("--root", required=True, help="dataset root (read only)")
    ap.add_argument("--csv", default="", help="exam_csv: the CSV file")
    ap.add_argument("--protocol", default="partial", choices=["partial", "full"])
    ap.add_argument("--ratio", default="1/8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="output/pipeline")
    ap.add_argument("--configs", default=os.path.join(REPO, "configs"),
                    help="config root: configs (paper sizes) or configs/demo")
    ap.add_argument("--methods", nargs="+", default=["braixdet"],
                    choices=[CAM_ONLY, *METHODS], help="rows to produce (default: braixdet)")
    ap.add_argument("--num-gpus", type=int, default=1)
    ap.add_argument("--num-machines", type=int, default=1)
    ap.add_argument("--machine-rank", type=int, default=0)
    ap.add_argument("--dist-url", default="auto")
    ap.add_argument("--opts", nargs="*", default=[], help="overrides for every stage")
    ap.add_argument("--stage1-opts", nargs="*", default=[], help="overrides for stage 1")
    ap.add_argument("--det-opts", nargs="*", default=[], help="overrides for the detectors")
    return ap.parse_args(argv)


class Pipeline:
    def __init__(self, args):
        self.args = args
        self.out = os.path.abspath(args.out)
        self.python = sys.executable
        self.common = [
            "DATASETS.BRAIXDET.FORMAT", args.dataset, "DATASETS.BRAIXDET.ROOT", args.root,
            "DATASETS.BRAIXDET.CSV", args.csv, "DATASETS.BRAIXDET.PROTOCOL", args.protocol,
            "DATASETS.BRAIXDET.RATIO", args.ratio, "DATASETS.BRAIXDET.SEED", str(args.seed),
            "DATASETS.BRAIXDET.SPLIT_DIR", os.path.join(self.out, "splits"),
            "INPUT.BRAIXDET.CACHE_DIR", os.path.join(self.out, "cache"), "SEED", str(args.seed),
        ] + list(args.opts)
        self.timings = {}

    def dir(self, stage):
        return os.path.join(self.out, stage)

    def config(self, rel):
        return os.path.join(self.args.configs, rel)

    def run(self, name, cmd):
        """Run one stage; its full output goes to <out>/logs/<name>.log, progress to stdout."""
        log_dir = os.path.join(self.out, "logs")
        os.makedirs(log_dir, exist_ok=True)
        log_path = os.path.join(log_dir, name.replace(":", "_") + ".log")
        print(f"\n=== [{name}] {os.path.basename(cmd[1])} (full log: {log_path})", flush=True)
        t0 = time.time()
        tail = []
        with open(log_path, "w") as log, subprocess.Popen(
                cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                bufsize=1) as proc:
            for line in proc.stdout:
                log.write(line)
                tail = (tail + [line])[-60:]
                if PROGRESS.search(line):
                    shown = LOG_PREFIX.sub("", ANSI.sub("", line.rstrip()))
                    print("   " + shown[:170], flush=True)
        if proc.returncode != 0:
            sys.stdout.write("".join(tail))
            raise RuntimeError(f"stage {name} failed (exit {proc.returncode}); see {log_path}")
        self.timings[name] = round(time.time() - t0, 1)

    def launch_args(self):
        a = self.args
        return ["--num-gpus", str(a.num_gpus), "--num-machines", str(a.num_machines),
                "--machine-rank", str(a.machine_rank), "--dist-url", a.dist_url]

    def train(self, name, config, opts, done_file="model_final.pth"):
        out = self.dir(name)
        done = os.path.join(out, done_file)
        if os.path.exists(done):
            print(f"=== [{name}] skipped: {done} exists")
            return done
        # --resume: a re-run after a crash continues from <out>/last_checkpoint
        self.run(name, [self.python, os.path.join(TOOLS, "train_net.py"), "--config-file",
                        config, "--resume", *self.launch_args(), *self.common,
                        "OUTPUT_DIR", out, *opts])
        return done

    def stage1(self, name):
        return self.train(name, self.config(STAGE1[name]), self.args.stage1_opts)

    def gradcam(self, mvccl_weights):
        out = os.path.join(self.dir("mvccl"), "gradcam_pseudo_boxes.json")
        if os.path.exists(out):
            print(f"=== [gradcam] skipped: {out} exists")
            return out
        self.run("gradcam", [self.python, os.path.join(TOOLS, "gradcam_pseudo_labels.py"),
                             "--config-file", self.config(STAGE1["mvccl"]), "--weights",
                             mvccl_weights, "--out", out, *self.common, "OUTPUT_DIR",
                             self.dir("mvccl"), *self.args.stage1_opts])
        return out

    def cam_settings(self):
        """(METHOD, TARGET_LAYER) the stage-1 config uses for Algorithm 1."""
        from braixdet.engine.setup import build_cfg

        c = build_cfg(self.config(STAGE1["mvccl"]), self.args.stage1_opts).MODEL.BRAIXDET.CAM
        return c.METHOD, c.TARGET_LAYER

    def cam_only(self, mvccl_weights):
        """CAM-only rows: the configured Algorithm 1 first, then the paper's GradCAM at res5
        and LayerCAM at res4 where the configuration is neither, so both are always shown."""
        rows = {}
        for method, layer in dict.fromkeys([self.cam_settings(), PAPER_CAM, LOCALISING_CAM]):
            name = f"cam_only_{method}_{layer}"
            out = self.dir(name)
            if not os.path.exists(os.path.join(out, "metrics.json")):
                self.run(name, [
                    self.python, os.path.join(TOOLS, "gradcam_pseudo_labels.py"),
                    "--config-file", self.config(STAGE1["mvccl"]), "--weights", mvccl_weights,
                    "--evaluate", self.test_name(), "--eval-out", out, *self.common,
                    "OUTPUT_DIR", self.dir("mvccl"), *self.args.stage1_opts,
                    "MODEL.BRAIXDET.CAM.METHOD", method, "MODEL.BRAIXDET.CAM.TARGET_LAYER",
                    layer])
            paper = " (paper)" if (method, layer) == PAPER_CAM else ""
            label = f"CAM only ({'GradCAM' if method == 'gradcam' else 'LayerCAM'} {layer}" \
                    f"{paper})"
            rows[label] = read_metrics(out)
        return rows

    def detector(self, key, stage1_weights, cam_json):
        m = METHODS[key]
        opts = ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", stage1_weights[m.init]]
        if m.cam:
            opts += ["SSL.CAM_JSON", cam_json]
        self.train(key, self.config(m.config), [*opts, *self.args.det_opts], done_file=EXPORT)
        # the trainer leaves the exported (best-validation) model's test metrics here
        return read_metrics(os.path.join(self.dir(key), "inference", "model", self.test_name()))

    def test_name(self):
        return f"{self.args.dataset}_test"

    def classifier_metrics(self, name):
        """Validation and test AUC of a stage-1 classifier (its end-of-training evaluation)."""
        out = {}
        folder = os.path.join(self.dir(name), "inference", "model")
        for split, ds in (("val", f"{self.args.dataset}_val_s{self.args.seed}"),
                          ("test", f"{self.args.dataset}_test_cls")):
            path = os.path.join(folder, ds, "classification_metrics.json")
            if os.path.exists(path):
                with open(path) as f:
                    out[split] = json.load(f)["classification"]
        return out

    def run_all(self):
        a = self.args
        needed = {METHODS[m].init for m in a.methods if m in METHODS}
        if CAM_ONLY in a.methods or any(METHODS[m].cam for m in a.methods if m in METHODS):
            needed.add("mvccl")
        stage1 = {name: self.stage1(name) for name in STAGE1 if name in needed}
        cam_json = self.gradcam(stage1["mvccl"]) if "mvccl" in stage1 and any(
            METHODS[m].cam for m in a.methods if m in METHODS) else ""
        results = {}
        if CAM_ONLY in a.methods:
            results.update(self.cam_only(stage1["mvccl"]))
        for key in a.methods:
            if key in METHODS:
                results[METHODS[key].label] = self.detector(key, stage1, cam_json)
        summary = {"results": results,
                   "classifiers": {n: self.classifier_metrics(n) for n in stage1},
                   "cam_quality": read_cam_quality(cam_json),
                   "timings_s": self.timings,
                   "protocol": {"dataset": a.dataset, "protocol": a.protocol, "ratio": a.ratio,
                                "seed": a.seed}}
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(format_table(results))
        print(format_classifiers(summary["classifiers"]))
        return summary


def read_metrics(folder):
    """The evaluator's metrics.json below ``folder`` (one test set)."""
    for dirpath, _, files in sorted(os.walk(folder)):
        if "metrics.json" in files:
            with open(os.path.join(dirpath, "metrics.json")) as f:
                return json.load(f)
    raise FileNotFoundError(f"no metrics.json under {folder}")


def read_cam_quality(cam_json):
    if not cam_json or not os.path.exists(cam_json):
        return None
    with open(cam_json) as f:
        return json.load(f)["meta"].get("quality")


def _metric(m, key):
    m = m.get("bbox", m)
    v = m.get(key)
    return "n/a" if v is None else f"{float(v):.1f}"


def format_table(results):
    lines = ["| Method | AP@IoU0.2 (%) | Recall@0.5 FPPI (%) |", "|---|---|---|"]
    for name, m in results.items():
        lines.append(f"| {name} | {_metric(m, 'AP20')} | {_metric(m, 'R@0.5')} |")
    return "\n".join(lines)


def format_classifiers(classifiers):
    lines = ["| Stage-1 classifier | val AUC | test AUC |", "|---|---|---|"]
    for name, m in classifiers.items():
        auc = [m.get(s, {}).get("AUC") for s in ("val", "test")]
        lines.append(f"| {name} | " + " | ".join(
            "n/a" if v is None else f"{v:.3f}" for v in auc) + " |")
    return "\n".join(lines)


def main(argv=None):
    return Pipeline(parse_args(argv)).run_all()


if __name__ == "__main__":
    main()
