"""The two-stage BRAIxDet pipeline on one dataset and seed, each stage skipped when done.

Stages (each a package entry point run as a child process, ``python -m
braixdet.pipeline.train_net`` / ``gradcam_pseudo_labels``; tools/ has the same two as scripts):
  mvccl                   BRAIxMVCCL classifier pre-training (D_s ∪ D_w, labels only)
  classifier_single_view  single-view EfficientNet classifier, same data (baseline init)
  gradcam                 Algorithm 1 pseudo-boxes of the weak cancers (+ their hit rate)
  one folder per method (METHODS): the detector, its exported model (best on validation) and
                          its test metrics (AP@0.2, FROC)
Every row of the paper's ablation (Table 6) is a method; stage-1 models are trained once and
shared by the rows that need them, as in the paper; a detector starts from its classifier's
best-on-validation export. A stage is done when its done-marker exists (written last); a
killed or stopped pipeline re-run continues: finished stages are skipped and training stages
resume from their last checkpoint.
"""
import argparse
import os
import sys
import time
from dataclasses import dataclass

from detectron2.data import DatasetCatalog

from ..config import ConfigValueError, build_cfg, check_module_keys, ratio_string, resolve_cfg
from ..config.schedule import stage2_epochs_opts
from ..data.protocols import PROTOCOLS
from ..data.register import RegistrationSpec, dataset_names, register_from_cfg
from ..engine.hooks import TrainingTimeHook
from ..engine.trainers import EXPORT_NAME
from ..model_zoo import config_root, resolve_config_root
from ..utils.io import atomic_write_json
from .methods import CAM_ONLY, LOCALISING_CAM, METHODS, PAPER_CAM, STAGE1, method_order
from .results import (
    format_classifiers,
    format_table,
    read_cam_quality,
    read_metrics,
)
from .stages import StageFailed, done_marker, is_done, mark_done, read_json, run_stage


def add_pipeline_arguments(ap, root_required=True):
    """The arguments of one pipeline run (tools/run_pipeline.py; run_experiments/run_demo
    pass theirs through)."""
    ap.add_argument("--dataset", default="cbis_ddsm",
                    choices=["cbis_ddsm", "vindr_mammo", "exam_csv"])
    ap.add_argument("--root", required=root_required, help="dataset root (read only)")
    ap.add_argument("--csv", default="", help="exam_csv: the CSV file")
    # partial: paper Tables 2/4; full: Tables 3/6 (all boxes + the weak images); supervised_only:
    # Table 5 (all boxes, no weak image)
    ap.add_argument("--protocol", default="partial", choices=list(PROTOCOLS))
    ap.add_argument("--ratio", default="1/8")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="output/pipeline")
    ap.add_argument("--configs", default="",
                    help="config root: a folder (configs, configs/demo) or a packaged one "
                         "(default: the paper's; 'demo': the demo's), braixdet/model_zoo.py")
    ap.add_argument("--methods", nargs="+", default=["braixdet"],
                    choices=[CAM_ONLY, *METHODS], help="rows to produce (default: braixdet)")
    ap.add_argument("--num-gpus", type=int, default=1)
    ap.add_argument("--num-machines", type=int, default=1)
    ap.add_argument("--machine-rank", type=int, default=0)
    ap.add_argument("--dist-url", default="auto")
    ap.add_argument("--opts", nargs="*", default=[], help="overrides for every stage")
    ap.add_argument("--stage1-opts", nargs="*", default=[], help="overrides for stage 1")
    ap.add_argument("--det-opts", nargs="*", default=[], help="overrides for the detectors")
    return ap


def demo_config_args(root, out, *, size, stage1_epochs, det_epochs, cache_dir, methods, seed=0,
                     ratio="1/8", protocol="partial", det_opts=()):
    """One pipeline run's arguments on the demo configs read at ``size`` (h, w), with stage 1's
    and the detectors' schedules in epochs (the fusion window moved along) and a shared image
    cache: what the demo and every benchmark script run."""
    h, w = size
    return add_pipeline_arguments(argparse.ArgumentParser()).parse_args([
        "--dataset", "cbis_ddsm", "--root", root, "--protocol", protocol, "--ratio", ratio,
        "--seed", str(seed), "--out", out, "--configs", os.path.join(config_root(), "demo"),
        "--methods", *methods, "--opts", "INPUT.BRAIXDET.CANONICAL_SIZE", f"({h}, {w})",
        "INPUT.BRAIXDET.CACHE_DIR", cache_dir,
        "--stage1-opts", "SOLVER.BRAIXDET.EPOCHS", str(stage1_epochs),
        "--det-opts", *stage2_epochs_opts(det_epochs), *det_opts])


@dataclass(frozen=True)
class Plan:
    """What one seed's pipeline runs, in order: the cluster launcher makes one job of each."""
    stage1: tuple  # STAGE1 names the rows start from
    gradcam: bool  # Algorithm 1 pseudo-boxes (a row reads SSL.CAM_JSON)
    cam_only: bool  # the CAM-only rows
    detectors: tuple  # METHODS keys, dependencies (teacher_from) first
    no_weak: bool  # the full protocol on a source without weak cases (SSL rows supervised)

    def jobs(self):
        return [*self.stage1, *(["gradcam"] if self.gradcam else []),
                *(["cam_only"] if self.cam_only else []), *self.detectors]

    def after(self, job):
        """The jobs ``job`` starts from (their outputs are its inputs)."""
        if job in STAGE1:
            return ()
        if job in ("gradcam", CAM_ONLY):
            return ("mvccl",)
        m = METHODS[job]
        return (m.init, *(["gradcam"] if m.cam and self.gradcam else []),
                *([m.teacher_from] if m.teacher_from else []))


class Pipeline:
    def __init__(self, args, job=None):
        """``job``: run that job of ``plan().jobs()`` only (a cluster job): a stage of
        another job that is not done is an error, not trained here. "summary": run nothing."""
        self.args = args
        self.out = os.path.abspath(args.out)
        self.python = sys.executable
        self.configs = resolve_config_root(args.configs)
        self.common = [
            "DATASETS.BRAIXDET.FORMAT", args.dataset, "DATASETS.BRAIXDET.ROOT", args.root,
            "DATASETS.BRAIXDET.CSV", args.csv, "DATASETS.BRAIXDET.PROTOCOL", args.protocol,
            "DATASETS.BRAIXDET.RATIO", ratio_string(args.ratio),
            "DATASETS.BRAIXDET.SEED", str(args.seed),
            "DATASETS.BRAIXDET.SPLIT_DIR", os.path.join(self.out, "splits"),
            "INPUT.BRAIXDET.CACHE_DIR", os.path.join(self.out, "cache"), "SEED", str(args.seed),
        ] + list(args.opts)
        self.timings, self.cpu_timings = {}, {}  # stage -> seconds (wall, CPU)
        self.row_stage = {}  # table row -> the stage that trained or scored it (its run time)
        self._stage1_cfg = None
        self.no_weak = False  # the full protocol on a source without weak cases (plan)
        self.job = job

    def dir(self, stage):
        return os.path.join(self.out, stage)

    def config(self, rel):
        return os.path.join(self.configs, rel)

    def run(self, name, cmd):
        """Run one stage (stages.run_stage); its full output goes to <out>/logs/<name>.log."""
        t0 = time.time()
        cpu = run_stage(name, cmd, os.path.join(self.out, "logs", name.replace(":", "_") + ".log"))
        self.timings[name] = round(time.time() - t0, 1)
        # CPU time of the stage's processes: unlike wall time, not inflated by other jobs
        self.cpu_timings[name] = round(cpu, 1)

    def timed(self, name):
        """The done-marker's record of a stage's run time."""
        return {"seconds": self.timings.get(name), "cpu_seconds": self.cpu_timings.get(name)}

    def tool(self, name):
        """The command of a stage entry point (a module of this package, not a script path:
        an installed package runs it from any directory)."""
        return [self.python, "-m", f"braixdet.pipeline.{name}"]

    def launch_args(self):
        a = self.args
        return ["--num-gpus", str(a.num_gpus), "--num-machines", str(a.num_machines),
                "--machine-rank", str(a.machine_rank), "--dist-url", a.dist_url]

    def stage1_cfg(self):
        """The stage-1 config with this run's overrides, as its stages build it; built once
        (dataset names, D_w, Algorithm 1's settings)."""
        if self._stage1_cfg is None:
            self._stage1_cfg = self.stage_cfg("mvccl")
        return self._stage1_cfg

    def names(self):
        """{role: registered dataset name} (data/register.py) of this run's dataset."""
        b = self.stage1_cfg().DATASETS.BRAIXDET
        return dataset_names(b.NAME or b.FORMAT, b.PROTOCOL, b.RATIO, b.SEED, b.TEST_IMAGES)

    def has_weak_images(self):
        """Whether D_w holds an image: counted in the split file a stage-1 run wrote to
        <out>/splits (no image read); before any stage ran, by loading the dataset as the
        stages will."""
        cfg = self.stage1_cfg()
        saved = RegistrationSpec.from_cfg(cfg).saved_split()
        if saved is not None:
            return len(saved["train_weak"]) > 0
        return len(DatasetCatalog.get(register_from_cfg(cfg)["train_weak"])) > 0

    def test_name(self):
        return self.names()["test"]

    def skipped(self, name, folder, job=None):
        """Whether stage ``name`` (of job ``job``, default ``name``) is done; a cluster job
        refuses to run another job's stage (that job failed or was cancelled)."""
        if not is_done(folder) and self.job is not None and self.job != (job or name):
            raise StageFailed(f"error: stage {name} of {self.out} is not done: its job failed "
                              "or was cancelled; submit the grid again")
        if is_done(folder):
            print(f"=== [{name}] skipped: {folder} is done")
            marker = read_json(done_marker(folder))  # the run times of the run that did it
            for key, timings in (("seconds", self.timings), ("cpu_seconds", self.cpu_timings)):
                if marker.get(key) is not None:
                    timings.setdefault(name, marker[key])
            return True
        return False

    def train(self, name, config, opts):
        """Train one stage in <out>/<name>; its done-marker is written after training and
        the final evaluation ended. Returns the folder."""
        out = self.dir(name)
        if not self.skipped(name, out):
            # --resume: a re-run after a crash or a stop continues from <out>/last_checkpoint
            self.run(name, [*self.tool("train_net"), "--config-file", config, "--resume",
                            *self.launch_args(), *self.common, "OUTPUT_DIR", out, *opts])
            # a resumed stage: add the time its earlier attempts spent up to the checkpoint
            earlier_path = os.path.join(out, TrainingTimeHook.EARLIER_ATTEMPTS)
            earlier = read_json(earlier_path) if os.path.exists(earlier_path) else {}
            for key, timings in (("seconds", self.timings), ("cpu_seconds", self.cpu_timings)):
                if name in timings and key in earlier:
                    timings[name] = round(timings[name] + earlier[key], 1)
            mark_done(out, stage=name, config=config, **self.timed(name))
        return out

    def stage1(self, name):
        """Stage-1 classifier; returns the model stage 2 starts from: the best-on-validation
        export when the trainer wrote one (paper §4.3 model selection), else the last."""
        out = self.train(name, self.config(STAGE1[name]), self.args.stage1_opts)
        best = os.path.join(out, EXPORT_NAME)
        return best if os.path.exists(best) else os.path.join(out, "model_final.pth")

    def cam_json(self):
        """Where the GradCAM stage writes Algorithm 1's pseudo-boxes."""
        return os.path.join(self.dir("mvccl"), "gradcam_pseudo_boxes.json")

    def gradcam(self, mvccl_weights):
        out = self.cam_json()
        folder = self.dir("gradcam")
        if not self.skipped("gradcam", folder):
            self.run("gradcam", [*self.tool("gradcam_pseudo_labels"),
                                 "--config-file", self.config(STAGE1["mvccl"]), "--weights",
                                 mvccl_weights, "--out", out, *self.common, "OUTPUT_DIR",
                                 self.dir("mvccl"), *self.args.stage1_opts])
            mark_done(folder, stage="gradcam", output=out, **self.timed("gradcam"))
        return out

    def cam_settings(self):
        """(METHOD, TARGET_LAYER) the stage-1 config uses for Algorithm 1."""
        c = self.stage1_cfg().MODEL.BRAIXDET.CAM
        return c.METHOD, c.TARGET_LAYER

    def cam_only(self, mvccl_weights):
        """CAM-only rows: the configured Algorithm 1 first, then the paper's GradCAM at res5
        and LayerCAM at res4 where the configuration is neither, so both are always shown."""
        rows = {}
        for method, layer in dict.fromkeys([self.cam_settings(), PAPER_CAM, LOCALISING_CAM]):
            name = f"cam_only_{method}_{layer}"
            out = self.dir(name)
            if not self.skipped(name, out, job=CAM_ONLY):
                self.run(name, [
                    *self.tool("gradcam_pseudo_labels"),
                    "--config-file", self.config(STAGE1["mvccl"]), "--weights", mvccl_weights,
                    "--evaluate", self.test_name(), "--eval-out", out, *self.common,
                    "OUTPUT_DIR", self.dir("mvccl"), *self.args.stage1_opts,
                    "MODEL.BRAIXDET.CAM.METHOD", method, "MODEL.BRAIXDET.CAM.TARGET_LAYER",
                    layer])
                mark_done(out, stage=name, **self.timed(name))
            paper = " (paper)" if (method, layer) == PAPER_CAM else ""
            label = f"CAM only ({'GradCAM' if method == 'gradcam' else 'LayerCAM'} {layer}" \
                    f"{paper})"
            rows[label] = read_metrics(out)
            self.row_stage[label] = name
        return rows

    def detector(self, key, stage1_weights, cam_json):
        """Train method ``key`` (METHODS); returns the exported model's test metrics."""
        self.train(key, self.config(METHODS[key].config),
                   self.detector_opts(key, stage1_weights, cam_json))
        # the trainer leaves the exported (best-validation) model's test metrics here
        return read_metrics(os.path.join(self.dir(key), "inference", "model", self.test_name()))

    def detector_opts(self, key, stage1_weights, cam_json):
        """The config overrides of method ``key``'s detector stage (after self.common)."""
        m = METHODS[key]
        opts = ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", stage1_weights[m.init], *m.opts]
        if m.cam:
            opts += ["SSL.CAM_JSON", cam_json]
        if m.teacher_from:
            opts += [m.teacher_key, os.path.join(self.dir(m.teacher_from), EXPORT_NAME)]
        if self.no_weak:
            opts += ["SSL.ENABLED", "False", "SSL.CAM_JSON", ""]
        return [*opts, *self.args.det_opts]

    def stage_cfg(self, job, cam_json=""):
        """The config of a stage-1 or detector job as its stage builds it (checked; datasets
        not resolved)."""
        if job in STAGE1:
            config, opts = self.config(STAGE1[job]), list(self.args.stage1_opts)
        else:
            exports = {n: os.path.join(self.dir(n), EXPORT_NAME) for n in STAGE1}
            config = self.config(METHODS[job].config)
            opts = self.detector_opts(job, exports, cam_json)
        return build_cfg(config, [*self.common, "OUTPUT_DIR", self.dir(job), *opts])

    def iterations(self, job, plan):
        """Training iterations of a stage-1 or detector job, from its config and datasets as
        the stage will resolve them (config/schedule.py); for the launcher's --dry-run."""
        cfg = resolve_cfg(self.stage_cfg(job, self.cam_json() if plan.gradcam else ""))
        return int(cfg.SOLVER.MAX_ITER)

    def classifier_metrics(self, name):
        """Validation and test AUC of a stage-1 classifier's exported model (the one stage 2
        starts from: engine/trainers.py evaluates it again when it was not the last)."""
        out = {}
        folder = os.path.join(self.dir(name), "inference", "model")
        names = self.names()
        for split, ds in (("val", names["val"]), ("test", names["test_cls"])):
            path = os.path.join(folder, ds, "classification_metrics.json")
            if os.path.exists(path):
                out[split] = read_json(path)["classification"]
        return out

    def stage1_jobs(self):
        """The stage-1 classifiers the rows of ``--methods`` start from."""
        a = self.args
        needed = {METHODS[k].init for k in method_order(a.methods)}
        if CAM_ONLY in a.methods or any(METHODS[k].cam for k in method_order(a.methods)):
            needed.add("mvccl")
        return tuple(n for n in STAGE1 if n in needed)

    def plan(self):
        """The stages of ``--methods``; under the full protocol whether D_w holds an image
        (no_weak; has_weak_images: free once a stage-1 run wrote the split)."""
        a = self.args
        keys = method_order(a.methods)
        uses_cam = any(METHODS[k].cam for k in keys)
        self.no_weak = a.protocol != "partial" and not self.has_weak_images()
        if self.no_weak and uses_cam:
            # our choice: without weak images there is nothing to pseudo-label; the SSL rows
            # train as their supervised detectors on every box (the paper's "fully labelled")
            print(f"=== [gradcam] skipped: the {a.protocol} protocol's D_w holds no image here; "
                  "SSL rows train as their supervised detectors (SSL.ENABLED False)", flush=True)
            uses_cam = False
        return Plan(stage1=self.stage1_jobs(), gradcam=uses_cam,
                    cam_only=CAM_ONLY in a.methods, detectors=tuple(keys), no_weak=self.no_weak)

    def job_done(self, job):
        """Whether every stage of ``job`` (a name of ``Plan.jobs``) is done."""
        if job == CAM_ONLY:
            return all(is_done(self.dir(f"cam_only_{m}_{layer}")) for m, layer in
                       dict.fromkeys([self.cam_settings(), PAPER_CAM, LOCALISING_CAM]))
        return is_done(self.dir(job))

    def run_job(self, job, plan):
        """One job of ``plan`` (a cluster job): its stage, from the stages of Plan.after(job)
        only (others of the seed may still be running)."""
        if job in STAGE1:
            return self.stage1(job)
        if job == CAM_ONLY:
            return self.cam_only(self.stage1("mvccl"))
        if job == "gradcam":
            return self.gradcam(self.stage1("mvccl"))
        m = METHODS[job]
        cam_json = self.gradcam(self.stage1("mvccl")) if plan.gradcam and m.cam else ""
        if m.teacher_from:  # its export is an input: refuse to start without it
            self.skipped(m.teacher_from, self.dir(m.teacher_from))
        return self.detector(job, {m.init: self.stage1(m.init)}, cam_json)

    def check_stages(self):
        """Refuse in seconds, naming the stage, a value that a stage still to train would
        refuse only when it starts, maybe hours in (check_config, and check_module_keys:
        --opts, --stage1-opts and --det-opts reach every row, also rows without an LCM)."""
        for name in (*self.stage1_jobs(), *method_order(self.args.methods)):
            if is_done(self.dir(name)):
                continue
            try:
                check_module_keys(self.stage_cfg(name))
            except ConfigValueError as e:
                raise ConfigValueError(e.key, e.value, e.allowed,
                                       message=f"{e} (stage {name})") from None

    def run_all(self):
        a = self.args
        self.check_stages()
        # stage 1 first: its run writes the split, from which plan() counts D_w
        stage1 = {name: self.stage1(name) for name in self.stage1_jobs()}
        plan = self.plan()
        cam_json = self.gradcam(stage1["mvccl"]) if plan.gradcam else ""
        results = {}
        if plan.cam_only:
            results.update(self.cam_only(stage1["mvccl"]))
        for key in plan.detectors:
            metrics = self.detector(key, stage1, cam_json)
            if key in a.methods:
                results[METHODS[key].label] = metrics
                self.row_stage[METHODS[key].label] = key
        summary = {"results": results,
                   "classifiers": {n: self.classifier_metrics(n) for n in stage1},
                   "stage1_models": stage1,
                   "cam_quality": read_cam_quality(cam_json),
                   "timings_s": self.timings, "cpu_timings_s": self.cpu_timings,
                   # None: done by a run older than the timing in its done-marker
                   "row_cpu_seconds": {r: self.cpu_timings.get(s)
                                       for r, s in self.row_stage.items()},
                   "protocol": {"dataset": a.dataset, "protocol": a.protocol, "ratio": a.ratio,
                                "seed": a.seed}}
        atomic_write_json(os.path.join(self.out, "results.json"), summary, indent=1)
        print(format_table(results))
        print(format_classifiers(summary["classifiers"]))
        return summary
