"""Two runs with the same config and seed give identical numbers on one machine.

Measured cause of the cross-run differences (engine/runtime.py): torch's intra-op thread count,
which defaults to the machine's cores. Cold vs warm canonical cache, the loaders' order and the
kernels are bit for bit reproducible on a CPU; NUM_THREADS fixes the thread count per config.
"""
import glob
import json
import os

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
