"""Two runs with the same config and seed give identical numbers on one machine.

Measured cause of the cross-run differences (engine/runtime.py): torch's intra-op thread count,
which defaults to the machine's cores. Cold vs warm canonical cache, the loaders' order and the
kernels are bit for bit reproducible on a CPU; NUM_THREADS fixes the thread count per config.
"""
import glob
import json
import os

import pytest
import torch
from _train_helpers import assert_state_equal, build_trainer, load_ckpt, run_train_net, tiny_opts

from braixdet.config import build_cfg


def _test_metrics(out):
    """{test set: metrics.json} of a finished detector run (validation and test sets)."""
    found = {}
    for path in sorted(glob.glob(os.path.join(out, "inference", "**", "metrics.json"),
                                 recursive=True)):
        with open(path) as f:
            m = json.load(f)
        found[m["dataset"]] = m
    assert found, f"no metrics.json under {out}"
    return found


def test_cold_then_warm_cache_give_identical_results(synthetic_root, tmp_path):
    cache = tmp_path / "cache"  # empty: the first run decodes every DICOM, the second reads
    runs = []
    for name in ("cold", "warm"):
        out = tmp_path / name
        run_train_net("faster_rcnn", tiny_opts(synthetic_root.root, out, cache,
                                               stage="faster_rcnn", max_iter=2,
                                               extra=["NUM_THREADS", "1"]))
        runs.append(out)
        if name == "cold":
            assert glob.glob(str(cache / "**" / "*.npy"), recursive=True), "cache not written"
    cold, warm = (_test_metrics(str(r)) for r in runs)
    assert cold == warm  # the results table: AP, FROC recalls, detection counts
    assert_state_equal(load_ckpt(runs[0] / "model_final.pth")["model"],
                       load_ckpt(runs[1] / "model_final.pth")["model"], "final weights")


def test_num_threads_is_applied_and_recorded(synthetic_root, tmp_path):
    before = torch.get_num_threads()
    try:
        cfg = build_cfg("", ["NUM_THREADS", "1"])
        assert torch.get_num_threads() == 1 and cfg.NUM_THREADS == 1
        assert "NUM_THREADS: 1" in cfg.dump()  # config.yaml records it
        torch.set_num_threads(2)
        build_cfg("", ["NUM_THREADS", "0"])  # 0: torch's default is left alone
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_same_seed_same_first_step_in_process(synthetic_root, tmp_path):
    """Two in-process trainers with one seed: identical weights after a step (no hash order,
    wall clock or unseeded RNG in the model, loader or step)."""
    states = []
    for name in ("a", "b"):
        trainer = build_trainer("faster_rcnn", tiny_opts(
            synthetic_root.root, tmp_path / name, tmp_path / "cache", stage="faster_rcnn",
            max_iter=1, extra=["NUM_THREADS", "1"]))
        trainer.train()
        states.append({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    assert_state_equal(states[0], states[1], "after one step")


def test_demo_jobs_run_stages_as_local_jobs_with_the_configs_threads(load_tool, tmp_path,
                                                                      monkeypatch, capsys):
    """tools/run_demo.py --jobs 2 trains the stages as local jobs (pipeline/launcher.py) into the
    one-seed demo's own folder, each with the demo configs' thread count (demo.stage_threads()), as
    --jobs 1 trains them in-process: so the table does not depend on --jobs (a local job trains
    the same numbers as the in-process run: test_pipeline_e2e.py's launcher test). --jobs 0 is
    refused."""
    from braixdet.pipeline import demo

    monkeypatch.setitem(demo.DEMO, "quick", dict(
        patients=16, rows=256, cols=160, separation=2.0, size=(64, 32), stage1_epochs=1.0,
        det_epochs=0.5, ceiling_epochs=0.5))
    tool = load_tool("run_demo")
    out = tmp_path / "demo_quick"
    tool.main(["--quick", "--out", str(tmp_path), "--methods", "faster_rcnn", "--jobs", "2"])
    assert "] local job " in capsys.readouterr().out
    threads = demo.stage_threads()
    for stage in ("classifier_single_view", "faster_rcnn"):
        config = (out / stage / "config.yaml").read_text()
        assert f"\nNUM_THREADS: {threads}\n" in config  # as the stage ran it
        assert (out / "logs" / f"{stage}.log").exists()
    from braixdet.model_zoo import config_root

    for base in ("Base-MVCCL.yaml", "Base-BRAIxDet.yaml"):  # stage 1 too: default_jobs' divisor
        text = open(os.path.join(config_root(), "demo", base)).read()
        assert f"\nNUM_THREADS: {threads}\n" in text
    results = json.loads((out / "results.json").read_text())
    assert list(results["results"]) == ["Faster R-CNN"]
    assert results["classifiers"]["classifier_single_view"]["test"]["AUC"] is not None
    with pytest.raises(SystemExit, match="--jobs 0"):
        tool.main(["--quick", "--out", str(tmp_path / "none"), "--jobs", "0"])


def test_local_launcher_runs_at_most_max_jobs_at_once_and_after_their_inputs(tmp_path,
                                                                             monkeypatch, capsys):
    """launcher._run_local through submitit's local executor: with --max-jobs 2, three ready
    jobs never run three at once, and a job waits for the job it needs; without a cap the
    three ready ones run together. Each job is a shell command that logs when it starts and
    ends. tools/run_experiments.py refuses a cap that would stop every job or do nothing."""
    import functools
    import subprocess

    from braixdet.pipeline import launcher

    log = tmp_path / "times.log"

    def command(job, *_):
        return functools.partial(subprocess.run, [
            "sh", "-c", f'echo "{job.key} start $(date +%s.%N)" >> {log}; sleep 1.5; '
                        f'echo "{job.key} end $(date +%s.%N)" >> {log}'], check=True)

    monkeypatch.setattr(launcher, "_callable", command)
    jobs = [launcher.Job(0, name, after, 0, "stage1") for name, after in
            (("a", ()), ("b", ()), ("c", ()), ("d", ("s0/a",)))]

    def most_at_once(max_jobs):
        log.write_text("")
        launcher._run_local(jobs, launcher.local_job_args(max_jobs, 1, 0), None, [0],
                            str(tmp_path), str(tmp_path / f"submitit{max_jobs}"))
        times = {}
        for line in log.read_text().split("\n"):
            if line:
                key, what, t = line.split()
                times.setdefault(key, {})[what] = float(t)
        assert times["s0/d"]["start"] >= times["s0/a"]["end"]  # after its input
        return max(sum(t["start"] <= s["start"] < t["end"] for t in times.values())
                   for s in times.values())

    assert most_at_once(2) == 2
    assert most_at_once(0) == 3
    from braixdet.pipeline.experiments import parse_args

    root = ["--root", str(tmp_path)]
    assert parse_args([*root, "--launcher", "local", "--max-jobs", "2"]).max_jobs == 2
    for argv, why in ((["--launcher", "local", "--max-jobs", "-1"], "0 (no cap)"),  # never runs
                      (["--launcher", "slurm", "--max-jobs", "2"], "would do nothing")):
        with pytest.raises(SystemExit):
            parse_args([*root, *argv])
        assert why in capsys.readouterr().err
