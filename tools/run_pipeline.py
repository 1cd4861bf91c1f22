#!/usr/bin/env python
"""The whole two-stage BRAIxDet pipeline on one dataset, each stage skipped when its output exists.

  python tools/run_pipeline.py --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --num-gpus 8 --out output/cbis_r1_8_s0

Stages (each also runnable alone with tools/train_net.py / tools/gradcam_pseudo_labels.py):
  1. mvccl     BRAIxMVCCL classifier pre-training      -> <out>/mvccl/model_final.pth
  2. gradcam   Algorithm 1 pseudo-boxes of weak cancers -> <out>/mvccl/gradcam_pseudo_boxes.json
  3. braixdet  student-teacher detector (teacher kept) -> <out>/braixdet/model_final.pth
  4. evaluate  teacher on the test split (AP@0.2, FROC) -> <out>/braixdet/eval/.../metrics.json
Optional: --baseline (single-view Faster R-CNN on the same split), --cam-only (GradCAM boxes
scored as detections). A killed pipeline re-run continues: finished stages are skipped and
training stages resume from their last checkpoint.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(REPO, "tools")
# lines worth showing while a stage runs: training progress, results, reports, problems
PROGRESS = re.compile(r"eta: |copypaste: \S|Split \(|bad inputs:|wrote |Error|error:|"
                      r"Initialised from|GradCAM fusion|Overall training speed")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
LOG_PREFIX = re.compile(r"^\[\d+/\d+ [\d:]+ [\w.]+\]:\s*")  # detectron2's "[date name]: "


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
    ap.add_argument("--mvccl-config", default=os.path.join(REPO, "configs/MVCCL/mvccl.yaml"))
    ap.add_argument("--det-config", default=os.path.join(REPO, "configs/BRAIxDet/braixdet.yaml"))
    ap.add_argument("--baseline-config",
                    default=os.path.join(REPO, "configs/baselines/faster_rcnn.yaml"))
    ap.add_argument("--baseline", action="store_true", help="also train the Faster R-CNN baseline")
    ap.add_argument("--cam-only", action="store_true", help="also score GradCAM boxes alone")
    ap.add_argument("--num-gpus", type=int, default=1)
    ap.add_argument("--num-machines", type=int, default=1)
    ap.add_argument("--machine-rank", type=int, default=0)
    ap.add_argument("--dist-url", default="auto")
    ap.add_argument("--opts", nargs="*", default=[], help="overrides for every stage")
    ap.add_argument("--mvccl-opts", nargs="*", default=[])
    ap.add_argument("--det-opts", nargs="*", default=[])
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
        self.timings[name] = time.time() - t0

    def launch_args(self):
        a = self.args
        return ["--num-gpus", str(a.num_gpus), "--num-machines", str(a.num_machines),
                "--machine-rank", str(a.machine_rank), "--dist-url", a.dist_url]

    def train(self, name, config, opts):
        out = self.dir(name)
        final = os.path.join(out, "model_final.pth")
        if os.path.exists(final):
            print(f"=== [{name}] skipped: {final} exists")
            return final
        # --resume: a re-run after a crash continues from <out>/last_checkpoint
        self.run(name, [self.python, os.path.join(TOOLS, "train_net.py"), "--config-file",
                        config, "--resume", *self.launch_args(), *self.common,
                        "OUTPUT_DIR", out, *opts])
        return final

    def evaluate(self, name, config, weights, opts):
        """Test metrics of a stage: those of its end-of-training evaluation (the teacher for
        SSL) when present, else a fresh ``--eval-only`` run."""
        trained = os.path.join(self.dir(name), "inference", "model", self.test_name())
        if os.path.exists(os.path.join(trained, "metrics.json")):
            return read_metrics(trained)
        out = os.path.join(self.dir(name), "eval")
        self.run(f"{name}:evaluate", [
            self.python, os.path.join(TOOLS, "train_net.py"), "--config-file", config,
            "--eval-only", *self.launch_args(), *self.common, "OUTPUT_DIR", out,
            "MODEL.WEIGHTS", weights, "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", *opts])
        return read_metrics(out)

    def gradcam(self, mvccl_weights):
        out = os.path.join(self.dir("mvccl"), "gradcam_pseudo_boxes.json")
        if os.path.exists(out):
            print(f"=== [gradcam] skipped: {out} exists")
            return out
        self.run("gradcam", [self.python, os.path.join(TOOLS, "gradcam_pseudo_labels.py"),
                             "--config-file", self.args.mvccl_config, "--weights", mvccl_weights,
                             "--out", out, *self.common, "OUTPUT_DIR", self.dir("mvccl"),
                             *self.args.mvccl_opts])
        return out

    def cam_only(self, mvccl_weights, test_name):
        out = os.path.join(self.dir("cam_only"))
        self.run("cam_only", [self.python, os.path.join(TOOLS, "gradcam_pseudo_labels.py"),
                              "--config-file", self.args.mvccl_config, "--weights",
                              mvccl_weights, "--evaluate", test_name, "--eval-out", out,
                              *self.common, "OUTPUT_DIR", self.dir("mvccl"),
                              *self.args.mvccl_opts])
        return read_metrics(out)

    def test_name(self):
        name = self.args.dataset
        return f"{name}_test"

    def run_all(self):
        a = self.args
        results = {}
        mvccl = self.train("mvccl", a.mvccl_config, a.mvccl_opts)
        cam_json = self.gradcam(mvccl)
        if a.cam_only:
            results["CAM only (GradCAM of BRAIxMVCCL)"] = self.cam_only(mvccl, self.test_name())
        if a.baseline:
            base = self.train("faster_rcnn", a.baseline_config, a.det_opts)
            results["Faster R-CNN (single view, D_s only)"] = self.evaluate(
                "faster_rcnn", a.baseline_config, base, a.det_opts)
        det_opts = ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", mvccl, "SSL.CAM_JSON", cam_json,
                    *a.det_opts]
        det = self.train("braixdet", a.det_config, det_opts)
        results["BRAIxDet (teacher)"] = self.evaluate("braixdet", a.det_config, det, a.det_opts)
        student = os.path.join(self.dir("braixdet"), "inference", "student", self.test_name())
        if os.path.exists(os.path.join(student, "metrics.json")):
            results["BRAIxDet (student)"] = read_metrics(student)
        summary = {"results": results, "timings_s": self.timings,
                   "protocol": {"dataset": a.dataset, "protocol": a.protocol, "ratio": a.ratio,
                                "seed": a.seed}}
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(format_table(results))
        return summary


def read_metrics(folder):
    """The evaluator's metrics.json below ``folder`` (one test set)."""
    for dirpath, _, files in sorted(os.walk(folder)):
        if "metrics.json" in files:
            with open(os.path.join(dirpath, "metrics.json")) as f:
                return json.load(f)
    raise FileNotFoundError(f"no metrics.json under {folder}")


def _metric(m, key):
    m = m.get("bbox", m)
    v = m.get(key)
    return "n/a" if v is None else f"{float(v):.1f}"


def format_table(results):
    lines = ["| Method | AP@IoU0.2 (%) | Recall@0.5 FPPI (%) |", "|---|---|---|"]
    for name, m in results.items():
        lines.append(f"| {name} | {_metric(m, 'AP20')} | {_metric(m, 'R@0.5')} |")
    return "\n".join(lines)


def main(argv=None):
    return Pipeline(parse_args(argv)).run_all()


if __name__ == "__main__":
    main()
