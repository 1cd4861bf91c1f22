"""The grid of tools/run_experiments.py as cluster jobs through submitit (Slurm or local).

One job per (seed, stage) of each seed's ``Plan``: the stage-1 classifiers (shared by the rows
that start from them), GradCAM and CAM only after BRAIxMVCCL, each detector after its classifier,
the GradCAM boxes if it reads them and the method it takes a teacher from; the summary job (the
in-process summary, reading finished stages only) after every job. Slurm: everything is
submitted at once with ``afterok`` dependencies; local: the same jobs through submitit's local
executor, each submitted once its dependencies have finished (that executor has none).

A stage that is done (its done-marker) is neither submitted nor waited for, so submitting the
grid again runs only what is missing. A preempted or timed-out job is checkpointed and requeued
by submitit (``Checkpointable``: the same call again); the requeued job skips its done stages
and resumes training from the stage's last checkpoint (train_net ``--resume``).
"""
import argparse
import copy
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import submitit

from ..cli import ToolError
from .ceiling import ceiling_when_ready
from .core import Pipeline
from .methods import CAM_ONLY, STAGE1
from .seeds import run_experiments, run_seeds, seed_args

SUMMARY = "summary"
POLL_S = 0.5  # how often the local launcher looks at its running jobs


def add_launcher_arguments(ap):
    """run_experiments.py: where the jobs run and what each may use."""
    ap.add_argument("--launcher", default="inprocess", choices=["inprocess", "local", "slurm"],
                    help="inprocess: one stage after another here (default); local/slurm: "
                         "one submitit job per (seed, stage), braixdet/pipeline/launcher.py")
    ap.add_argument("--partition", default="", help="Slurm partition")
    ap.add_argument("--gpus-per-job", type=int, default=1,
                    help="GPUs of a training job (one node; detectron2's launch starts one "
                         "process per GPU); --num-gpus of its stage")
    ap.add_argument("--cpus-per-job", type=int, default=10)
    ap.add_argument("--max-jobs", type=int, default=0,
                    help="local: at most this many jobs at once (default 0: every job whose "
                         "inputs are ready)")
    ap.add_argument("--timeout-min", type=int, default=24 * 60,
                    help="a job's time limit; at the limit it checkpoints and requeues")
    ap.add_argument("--max-requeue", type=int, default=20,
                    help="time limits a job may reach before it is not requeued again")
    ap.add_argument("--slurm-param", nargs="*", default=[], metavar="KEY=VALUE",
                    help="more sbatch options, e.g. account=abc constraint=a100")
    ap.add_argument("--dry-run", action="store_true",
                    help="print the jobs, their dependencies and GPU hours; submit nothing")
    ap.add_argument("--sec-per-iter", nargs="*", default=[], metavar="KIND=SECONDS",
                    help="stage1=S detector=S: seconds per training iteration on one GPU at "
                         "the run's size and batch, as the benchmarks measure them (--dry-run)")
    return ap


@dataclass(frozen=True)
class Job:
    seed: Optional[int]  # None: the summary job
    stage: str  # a name of Plan.jobs(), or SUMMARY
    after: tuple  # keys of the jobs it starts after
    gpus: int
    kind: str  # "stage1", "detector", "inference" (GradCAM, CAM only) or "summary"
    iterations: Optional[int] = None  # training iterations (--dry-run)

    @property
    def key(self):
        return SUMMARY if self.seed is None else f"s{self.seed}/{self.stage}"


def _kind(stage):
    return "stage1" if stage in STAGE1 else "inference" if stage in ("gradcam", CAM_ONLY) \
        else "detector"


def job_graph(args, seeds, out, gpus_per_job, count_iterations=False, per_seed_out=None):
    """The jobs of the grid, each after the jobs it needs (done stages left out)."""
    jobs = []
    for seed in seeds:
        pipe = Pipeline(seed_args(args, seed, out, per_seed_out))
        pipe.check_stages()  # a bad value ends the launch, not a job hours into the grid
        plan = pipe.plan()
        for stage in plan.jobs():
            if pipe.job_done(stage):
                continue  # a stage already done is never run again
            kind = _kind(stage)
            after = tuple(f"s{seed}/{d}" for d in plan.after(stage) if not pipe.job_done(d))
            iterations = pipe.iterations(stage, plan) if count_iterations and \
                kind != "inference" else None
            # GradCAM and CAM only run in one process (tools/gradcam_pseudo_labels.py)
            gpus = min(gpus_per_job, 1) if kind == "inference" else gpus_per_job
            jobs.append(Job(seed, stage, after, gpus, kind, iterations))
    jobs.append(Job(None, SUMMARY, tuple(j.key for j in jobs), 0, "summary"))
    return jobs


class StageJob(submitit.helpers.Checkpointable):
    """One (seed, stage) job. ``checkpoint`` (inherited) requeues this same call: done stages
    are skipped, training resumes from the stage's last checkpoint."""

    def __init__(self, args, seed, out, stage, per_seed_out=None):
        self.args, self.seed, self.out, self.stage = args, seed, out, stage
        self.per_seed_out = per_seed_out

    def __call__(self):
        pipe = Pipeline(seed_args(self.args, self.seed, self.out, self.per_seed_out),
                        job=self.stage)
        pipe.run_job(self.stage, pipe.plan())
        return self.stage


class SummaryJob(submitit.helpers.Checkpointable):
    """The grid's table from the finished stages (run_experiments with nothing left to run)."""

    def __init__(self, args, seeds, out):
        self.args, self.seeds, self.out = args, seeds, out

    def __call__(self):
        return run_experiments(self.args, self.seeds, self.out, job=SUMMARY)


def seconds_per_iteration(items):
    """--sec-per-iter stage1=S detector=S -> {kind: seconds}."""
    out = {}
    for item in items:
        kind, _, value = item.partition("=")
        if kind not in ("stage1", "detector"):
            raise ToolError(f"error: --sec-per-iter {item}: the kinds are stage1 and detector")
        try:
            out[kind] = float(value)
        except ValueError:
            raise ToolError(f"error: --sec-per-iter {item}: {value!r} is not a number") from None
    return out


def dry_run_table(jobs, sec_per_iter):
    """The jobs as a markdown table with their GPU hours, and the total."""
    lines = ["| job | after | GPUs | iterations | GPU hours |", "|---|---|---|---|---|"]
    total, unknown = 0.0, []
    for j in jobs:
        hours = "-"
        if j.iterations is not None:
            s = sec_per_iter.get(j.kind)
            if s is None:
                hours = "n/a"
                unknown.append(j.kind)
            else:
                # the benchmark times a whole batch on one GPU: N GPUs share it (ideal scaling)
                h = j.iterations * s / 3600
                total += h
                hours = f"{h:.1f}"
        lines.append(f"| {j.key} | {', '.join(j.after) or '-'} | {j.gpus} | "
                     f"{j.iterations if j.iterations is not None else '-'} | {hours} |")
    lines.append(f"\n{len(jobs)} jobs; training GPU hours: {total:.1f}" + (
        f" (without {', '.join(sorted(set(unknown)))}: pass --sec-per-iter)" if unknown else ""))
    lines.append("GPU hours = iterations x seconds per iteration of the whole batch on one GPU "
                 "(--sec-per-iter; measure stage1 with benchmarks/benchmark_stage1_step.py, "
                 "'median ms/step', and detector with benchmarks/benchmark_ssl_iteration.py, "
                 "'whole SSL step', on the cluster's GPU at the run's size and batch); GradCAM, "
                 "CAM only and the summary are inference and not counted.")
    return "\n".join(lines)


def _executor(args, folder, job, after_ids=()):
    """A submitit executor for ``job`` (one per job: no parameter leaks to the next)."""
    ex = submitit.AutoExecutor(folder=os.path.join(folder, "%j"), cluster=args.launcher,
                               slurm_max_num_timeout=args.max_requeue,
                               local_max_num_timeout=args.max_requeue)
    params = dict(name=f"braixdet-{job.key}", timeout_min=args.timeout_min, nodes=1,
                  tasks_per_node=1, cpus_per_task=args.cpus_per_job)
    if job.gpus:  # no GPU request at all for the summary (some Slurm refuse a count of 0)
        params["gpus_per_node"] = job.gpus
    if args.launcher == "slurm":
        # a failed stage removes its dependents rather than leaving them pending for ever
        bad = [item for item in args.slurm_param if "=" not in item]
        if bad:
            raise ToolError(f"error: --slurm-param {bad[0]}: expected KEY=VALUE")
        extra = {"kill-on-invalid-dep": "yes",
                 **dict(item.split("=", 1) for item in args.slurm_param)}
        if after_ids:
            extra["dependency"] = "afterok:" + ":".join(after_ids)
        params.update(slurm_partition=args.partition or None,
                      slurm_additional_parameters=extra)
    ex.update_parameters(**params)
    return ex


def _callable(job, args, seeds, out, per_seed_out=None):
    if job.seed is None:
        return SummaryJob(args, seeds, out)
    return StageJob(args, job.seed, out, job.stage, per_seed_out)


def _train_args(args, gpus_per_job):
    """The pipeline arguments a job's stages run with: --num-gpus is the job's GPUs (detectron2's
    launch inside the job)."""
    train_args = copy.copy(args)
    train_args.num_gpus = max(1, gpus_per_job)
    return train_args


def _job_folder(out):
    """Where submitit keeps the jobs' logs and pickles."""
    return os.path.join(out, "submitit")


def launch(args, seeds, out):
    """Submit the grid (or print it with --dry-run); local: wait for the summary."""
    out = os.path.abspath(out)
    train_args = _train_args(args, args.gpus_per_job)
    jobs = job_graph(train_args, seeds, out, args.gpus_per_job, count_iterations=args.dry_run)
    if args.dry_run:
        table = dry_run_table(jobs, seconds_per_iteration(args.sec_per_iter))
        print(table)
        return {"jobs": jobs, "table": table}
    folder = _job_folder(out)
    if args.launcher == "slurm":
        return _submit_slurm(jobs, args, train_args, seeds, out, folder)
    summary = _run_local(jobs, args, train_args, seeds, out, folder)[SUMMARY]
    with open(os.path.join(out, "summary.md")) as f:  # the summary job wrote it
        print("\n" + f.read() + f"\nwrote {out}/summary.md and summary.json; job logs in "
              f"{folder}/")
    return summary


def _submit_slurm(jobs, args, train_args, seeds, out, folder):
    ids = {}
    for j in jobs:  # job_graph lists every job after the jobs it needs
        after = [ids[k] for k in j.after]
        ex = _executor(args, folder, j, after)
        ids[j.key] = ex.submit(_callable(j, train_args, seeds, out)).job_id
        print(f"submitted {j.key}: Slurm job {ids[j.key]}"
              + (f" (after {', '.join(after)})" if after else ""), flush=True)
    print(f"the table will be {out}/summary.md (job {ids[SUMMARY]}); logs: {folder}/")
    return ids


def _job_error_line(exc):
    """The ``error: ...`` line of a failed job (submitit gives its traceback as text)."""
    lines = [line for line in str(exc).splitlines() if "error: " in line]
    return "error: " + lines[-1].split("error: ", 1)[1] if lines else \
        f"error: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"


def _run_local(jobs, args, train_args, seeds, out, folder, per_seed_out=None):
    """Each job once the jobs it needs have finished, at most ``--max-jobs`` at once, in the
    graph's order (stage 1 and GradCAM before the detectors: the longest chain first);
    returns {job key: its result}."""
    pending, running, finished, results = list(jobs), {}, set(), {}
    started = {}
    try:
        while pending or running:
            for j in [j for j in pending if all(k in finished for k in j.after)]:
                if args.max_jobs and len(running) >= args.max_jobs:
                    break
                ex = _executor(args, folder, j)
                running[j.key] = ex.submit(_callable(j, train_args, seeds, out, per_seed_out))
                started[j.key] = time.time()
                pending.remove(j)
                print(f"=== [{j.key}] local job {running[j.key].job_id}", flush=True)
            for key, sj in list(running.items()):
                if sj.done():
                    del running[key]
                    try:
                        results[key] = sj.result()
                    except Exception as e:  # noqa: BLE001 - one line naming the job and log
                        raise ToolError(f"{_job_error_line(e)} (job {key}; log: "
                                        f"{sj.paths.stdout})") from None
                    finished.add(key)
                    print(f"=== [{key}] done in {(time.time() - started[key]) / 60:.1f} min",
                          flush=True)
            time.sleep(POLL_S)
    finally:
        for sj in running.values():  # we stop early: stop what is still running
            sj.cancel()
    return results


def local_job_args(max_jobs=0, cpus_per_job=2, gpus_per_job=1):
    """The launcher arguments of a grid run as local jobs on this machine."""
    return add_launcher_arguments(argparse.ArgumentParser()).parse_args(
        ["--launcher", "local", "--gpus-per-job", str(gpus_per_job),
         "--cpus-per-job", str(cpus_per_job), "--max-jobs", str(max_jobs)])


def run_parallel(args, seeds, out, jobs, ceiling_epochs=0, per_seed_out=None):
    """Every stage of the grid as a local job (``jobs``: local_job_args) once its inputs are
    ready, and each seed's full-label ceiling (pipeline/ceiling.py) beside them once the
    classifier it starts from is done; returns the seeds' summaries, read from the finished
    stages (run_seeds with ``job="summary"``). Done stages are skipped, so a re-run continues."""
    out = os.path.abspath(out)
    train_args = _train_args(args, jobs.gpus_per_job)
    graph = [j for j in job_graph(train_args, seeds, out, jobs.gpus_per_job,
                                  per_seed_out=per_seed_out) if j.seed is not None]
    stop = threading.Event()
    with ThreadPoolExecutor(max(1, len(seeds))) as pool:
        ceilings = [pool.submit(ceiling_when_ready, seed_args(args, s, out, per_seed_out),
                                ceiling_epochs, stop) for s in seeds if ceiling_epochs]
        try:
            _run_local(graph, jobs, train_args, seeds, out, _job_folder(out), per_seed_out)
        finally:
            stop.set()  # a ceiling still waiting for its classifier will not get it
        for c in ceilings:
            c.result()  # its error, if it failed
    return run_seeds(args, seeds, out, per_seed_out, job=SUMMARY)
