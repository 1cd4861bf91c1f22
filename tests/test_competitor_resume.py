"""Issue 29 item 15: the resume mechanism of a competitor row (Soft Teacher: the one with the
most random state, its box jitter) is exact. The pipeline-level kill-and-resume of all three
competitors is measured once in docs/DESIGN.md §7a.3 (minutes, not a test).

~20 s of CPU (four Soft Teacher steps and two final evaluations); in the default suite since
it runs on two workers."""
import os

import _train_helpers as th
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_ITER, HALF = 2, 1


class _StopAfter:
    """A hook that interrupts training after iteration ``it`` (its checkpoint is written)."""

    def __init__(self, it):
        self.it = it

    def after_step(self):
        if self.trainer.iter == self.it:
            raise KeyboardInterrupt(f"stop after iteration {self.it}")


def test_soft_teacher_interrupted_and_resumed_equals_straight(synthetic_root, tmp_path,
                                                              monkeypatch):
    """1 iteration (burn-in), interruption after its checkpoint, a fresh trainer with resume,
    1 more: student and teacher identical to 2 straight iterations (every teacher box a
    pseudo-label, so the resumed step runs the pseudo-labelled, jittered path)."""
    from detectron2.engine import HookBase

    monkeypatch.setitem(th.CONFIGS, "soft_teacher", os.path.join(
        REPO, "configs", "demo", "baselines", "soft_teacher.yaml"))
    torch.set_num_threads(1)
    cache = tmp_path / "cache"

    def opts(out):
        return th.tiny_opts(synthetic_root.root, tmp_path / out, cache, stage="soft_teacher",
                            max_iter=N_ITER, ckpt_period=1,
                            extra=["SSL.BURN_IN_ITERS", "1", "SSL.TEACHER_SCORE_THRESH", "0.0",
                                   "SSL.JITTER_TIMES", "2"])

    straight = th.build_trainer("soft_teacher", opts("straight"))
    straight.train()

    stop = type("StopAfter", (_StopAfter, HookBase), {})(HALF - 1)
    t = th.build_trainer("soft_teacher", opts("resumed"))
    t.register_hooks([stop])
    with pytest.raises(KeyboardInterrupt):
        t.train()
    del t
    t = th.build_trainer("soft_teacher", opts("resumed"), resume=True)
    assert t.start_iter == HALF
    t.train()
    for name in ("model", "teacher"):
        th.assert_state_equal(
            th.load_ckpt(tmp_path / "straight" / "model_final.pth")[name],
            th.load_ckpt(tmp_path / "resumed" / "model_final.pth")[name], name)
