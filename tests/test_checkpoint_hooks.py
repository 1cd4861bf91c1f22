"""Atomic / weights-only checkpoints, the finite-loss check and the ReduceLROnPlateau hook."""
import collections
import copy
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from detectron2.checkpoint import DetectionCheckpointer
from detectron2.engine import SimpleTrainer
from detectron2.engine.hooks import EvalHook, LRScheduler
from detectron2.engine.train_loop import HookBase
from detectron2.solver import LRMultiplier
from fvcore.common.param_scheduler import ConstantParamScheduler
from torch import nn

from braixdet.engine.checkpoint import AtomicCheckpointer
from braixdet.engine.hooks import FiniteLossCheck, ReduceLROnPlateauHook, check_finite_losses
from braixdet.utils.checkpoint import CheckpointContentError, export_model_only


def _model(fill=None):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    if fill is not None:
        with torch.no_grad():
            for p in m.parameters():
                p.fill_(fill)
    return m


# ---------------------------------------------------------------- atomic save
def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model = _model(1.0)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # non-empty optimizer state
    ckpt = AtomicCheckpointer(model, str(tmp_path), optimizer=opt)
    ckpt.save("model_0000001", iteration=1)
    good = {k: v.clone() for k, v in model.state_dict().items()}

    real_save = torch.save

    def crashing_save(obj, f, *a, **k):  # write half a checkpoint, then "die"
        real_save(obj, f, *a, **k)
        f.seek(0)
        f.truncate(f.tell() // 2 or 10)
        raise KeyboardInterrupt("killed mid-write")

    with torch.no_grad():
        for p in model.parameters():
            p.fill_(2.0)
    monkeypatch.setattr(torch, "save", crashing_save)
    for name in ("model_0000001", "model_0000002"):  # overwrite and new file
        with pytest.raises(KeyboardInterrupt):
            ckpt.save(name, iteration=2)
    monkeypatch.setattr(torch, "save", real_save)

    assert sorted(os.listdir(tmp_path)) == ["last_checkpoint", "model_0000001.pth"]  # no .tmp
    assert ckpt.has_checkpoint()
    assert ckpt.get_checkpoint_file() == os.path.join(str(tmp_path), "model_0000001.pth")
    fresh = _model(0.0)
    opt2 = torch.optim.Adam(fresh.parameters())
    extra = AtomicCheckpointer(fresh, str(tmp_path), optimizer=opt2).resume_or_load("")
    assert extra["iteration"] == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, good[k]), k
    assert opt2.state_dict()["state"][0]["step"] == 1


_KILL_SCRIPT = textwrap.dedent("""
    import sys, torch
    from torch import nn
    from braixdet.engine.checkpoint import AtomicCheckpointer
    torch.set_num_threads(1)
    model = nn.Linear(2000, 2500)  # ~20 MB per checkpoint
    ckpt = AtomicCheckpointer(model, sys.argv[1])
    i = 0
    while True:
        with torch.no_grad():
            model.weight.fill_(i)
            model.bias.fill_(i)
        ckpt.save(f"model_{i % 2}", iteration=i)
        print(i, flush=True)
        i += 1
""")


def test_sigkill_during_saves_leaves_loadable_last_checkpoint(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(3):  # a few complete saves, then kill at some point of the next ones
            line = proc.stdout.readline()
            assert line, proc.stderr.read()
        time.sleep(0.137)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    model = nn.Linear(2000, 2500)
    ckpt = AtomicCheckpointer(model, str(tmp_path))
    path = ckpt.get_checkpoint_file()
    assert os.path.isfile(path)
    extra = ckpt.load(path)
    i = extra["iteration"]
    assert i >= 2 and path.endswith(f"model_{i % 2}.pth")
    assert torch.all(model.weight == i) and torch.all(model.bias == i)  # a complete file
    for f in ckpt.get_all_checkpoint_files():  # every visible .pth is complete
        torch.load(f, weights_only=True)
    for name in ("model_0", "model_1"):  # the next saves clear temp files left by the kill
        ckpt.save(name, iteration=i + 1)
    assert sorted(os.listdir(tmp_path)) == ["last_checkpoint", "model_0.pth", "model_1.pth"]


# ---------------------------------------------------------------- weights-only load
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    evil_pth = tmp_path / "evil.pth"
    torch.save({"model": {"w": torch.zeros(1)}, "x": _Evil(marker)}, evil_pth)
    # the payload is live: an unrestricted load runs it
    torch.load(evil_pth, weights_only=False)
    assert marker.exists()
    marker.unlink()

    ckpt = AtomicCheckpointer(_model(), str(tmp_path / "out"))
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load(str(evil_pth))
    assert not marker.exists()

    evil_pkl = tmp_path / "evil.pkl"  # model-zoo path: restricted unpickler
    with open(evil_pkl, "wb") as f:
        pickle.dump({"model": {}, "__author__": _Evil(marker)}, f)
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system|Refusing"):
        ckpt.load(str(evil_pkl))
    assert not marker.exists()

    raw_pickle = tmp_path / "raw.pth"  # a legacy (non-zip) pickle
    with open(raw_pickle, "wb") as f:
        pickle.dump({"model": _Evil(marker)}, f)
    with pytest.raises(pickle.UnpicklingError):
        ckpt.load(str(raw_pickle))
    assert not marker.exists()


def test_model_zoo_pkl_still_loads(tmp_path):
    model = _model()
    sd = {k: np.full_like(v.numpy(), 3) for k, v in model.state_dict().items()}
    for proto in (2, pickle.HIGHEST_PROTOCOL):
        path = tmp_path / f"zoo{proto}.pkl"
        with open(path, "wb") as f:
            pickle.dump({"model": sd, "__author__": "test"}, f, protocol=proto)
        fresh = _model()
        AtomicCheckpointer(fresh).load(str(path))
        assert torch.all(fresh[0].weight == 3)


class _Holder:
    def __init__(self, state):
        self.state = state

    def state_dict(self):
        return self.state

    def load_state_dict(self, s):
        self.state = s


@pytest.mark.parametrize(
    "bad, where",
    [
        ({"state": {"np": np.zeros(2)}}, "holder.state.np"),
        ({"hist": [1, 2, object()]}, "holder.hist[2]"),
        ({"dd": collections.defaultdict(list)}, "holder.dd"),
        ({"fn": len}, "holder.fn"),
    ],
)
def test_non_plain_values_refused_at_save(tmp_path, bad, where):
    ckpt = AtomicCheckpointer(_model(), str(tmp_path), holder=_Holder(bad))
    with pytest.raises(CheckpointContentError, match=re.escape(f"'checkpoint.{where}'")):
        ckpt.save("model_final")
    assert os.listdir(tmp_path) == []
    with pytest.raises(CheckpointContentError, match="checkpoint.extra"):
        AtomicCheckpointer(_model(), str(tmp_path)).save("m", extra=np.float64(1.0))


def test_export_model_only_loads_into_plain_model(tmp_path):
    teacher = _model(0.5)
    path = export_model_only(teacher, str(tmp_path / "sub" / "teacher.pth"))
    assert list(torch.load(path, weights_only=True)) == ["model"]
    for loader in (AtomicCheckpointer, DetectionCheckpointer):
        plain = _model(0.0)
        loader(plain).load(path)
        for k, v in plain.state_dict().items():
            assert torch.equal(v, teacher.state_dict()[k]), k


# ---------------------------------------------------------------- finite losses
def test_finite_loss_check_names_iteration_and_term():
    ok = {"loss_cls": torch.tensor(0.3), "loss_box_reg": 0.1}
    check_finite_losses(ok, 5)
    bad = {"loss_cls": torch.tensor(0.3), "loss_rpn_loc": torch.tensor(float("nan"))}
    with pytest.raises(FloatingPointError,
                       match=r"at iteration=17: loss_rpn_loc=nan"):
        check_finite_losses(bad, 17)
    with pytest.raises(FloatingPointError, match=r"iteration=3: wek/loss_cls=inf"):
        FiniteLossCheck()({"wek/loss_cls": float("inf")}, 3)
    FiniteLossCheck(enabled=False)(bad, 1)


def test_finite_loss_check_syncs_ranks(monkeypatch):
    # Under DDP a rank that raises alone would leave the others hanging in backward(): the flag
    # is all-reduced. (A real 2-process gloo run is in test_ssl's DDP test.)
    import torch.distributed as dist
    from detectron2.utils import comm

    calls = []

    def other_rank_bad(t):
        calls.append(float(t))
        t += 1

    monkeypatch.setattr(comm, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_reduce", other_rank_bad)
    with pytest.raises(FloatingPointError, match=r"iteration=4: on another rank"):
        check_finite_losses({"loss_cls": torch.tensor(0.5)}, 4)
    with pytest.raises(FloatingPointError, match=r"iteration=5: loss_cls=nan"):
        check_finite_losses({"loss_cls": torch.tensor(float("nan"))}, 5)
    assert calls == [0.0, 1.0]  # this rank's flag reaches the others too
    monkeypatch.setattr(dist, "all_reduce", lambda t: None)
    check_finite_losses({"loss_cls": torch.tensor(0.5)}, 6)


# ---------------------------------------------------------------- ReduceLROnPlateau
# Validation BCE per evaluation (EvalHook(2): iterations 1, 3, ..., 17, then after_train).
BCE = [1.0, 0.8, 0.85, 0.9, 0.8, 0.81, 0.5, 0.6, 0.6, 0.6, 0.6]
BASE_LRS = [0.1, 0.01]


class _Data:
    def __iter__(self):
        while True:
            yield torch.ones(2, 4)


class _LossModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(4, 1)

    def forward(self, x):
        return {"loss": (self.a(x) + self.b(x)).pow(2).mean()}


def _make_trainer(patience=1):
    torch.manual_seed(0)
    model = _LossModel()
    opt = torch.optim.SGD([{"params": model.a.parameters(), "lr": BASE_LRS[0]},
                           {"params": model.b.parameters(), "lr": BASE_LRS[1]}], lr=0.1)
    trainer = SimpleTrainer(model, _Data(), opt)
    sched = LRMultiplier(opt, ConstantParamScheduler(1.0), max_iter=100)
    plateau = ReduceLROnPlateauHook("bce", factor=0.1, patience=patience)
    trainer.register_hooks([
        LRScheduler(scheduler=sched),
        EvalHook(2, lambda: {"classification": {"BCE": BCE[trainer.iter // 2]},
                             "student/classification": {"BCE": 0.0}}),
        plateau,
    ])
    return trainer, opt, sched, plateau


def _lrs(trainer, start):
    return [v for v, it in trainer.storage.history("lr").values() if it >= start]


def test_plateau_hook_reduces_after_patience_and_resumes_exactly(tmp_path):
    trainer, opt, sched, plateau = _make_trainer(patience=1)
    trainer.train(0, 20)
    # evaluations at iters 1,3,...: 1.0 best, 0.8 best, 0.85 bad, 0.9 bad (> patience) -> ×0.1
    # at iter 7; 0.8 bad, 0.81 bad -> ×0.1 at iter 11; 0.5 best; 0.6, 0.6 -> ×0.1 at iter 17
    lrs = _lrs(trainer, 0)  # lr logged at each iteration before the scheduler step
    assert plateau.resolved_key == "classification/BCE"  # not the student's
    assert lrs[:8] == pytest.approx([0.1] * 8)
    assert lrs[8:12] == pytest.approx([0.01] * 4)
    assert lrs[12:18] == pytest.approx([0.001] * 6)
    assert lrs[18:] == pytest.approx([0.0001] * 2)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-4, 1e-5])
    assert sched.base_lrs == pytest.approx([1e-4, 1e-5])
    assert plateau.num_reductions == 3 and plateau.best == 0.5

    # Interrupted run: checkpoint (through AtomicCheckpointer: plain values only) at iter 9,
    # between the first and second reductions, then resume in a fresh trainer.
    t1, _, _, p1 = _make_trainer(patience=1)
    ckpt = AtomicCheckpointer(t1.model, str(tmp_path), trainer=t1)

    saved = {}

    class _Save(HookBase):
        def after_step(self):
            if self.trainer.iter == 9:
                ckpt.save("model_0000009")
                saved.update(p1.state_dict())

    t1.register_hooks([_Save()])  # after the plateau hook
    t1.train(0, 11)  # (max_iter 10 would move the iteration-9 evaluation to after_train)
    assert saved["num_reductions"] == 1
    # the final evaluation, in after_train (0.81, the second bad one), counts too: a finished
    # run's last decision is in the state it ends with
    assert p1.num_reductions == 2 and p1.last_eval_iter == 11

    t2, opt2, sched2, p2 = _make_trainer(patience=1)
    AtomicCheckpointer(t2.model, str(tmp_path), trainer=t2).resume_or_load("", resume=True)
    assert t2.iter == 9 and p2.state_dict() == saved
    assert [g["lr"] for g in opt2.param_groups] == pytest.approx([0.01, 0.001])
    t2.train(10, 20)
    assert _lrs(t2, 10) == pytest.approx(lrs[10:])
    assert p2.state_dict() == plateau.state_dict()
    assert sched2.base_lrs == pytest.approx(sched.base_lrs)


def test_plateau_state_roundtrip_and_semantics():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    h = ReduceLROnPlateauHook("val/bce", factor=0.1, patience=2, optimizer=opt)
    assert [h.step(v) for v in (1.0, 1.0, 2.0, float("nan"))] == [False, False, False, True]
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
    state = copy.deepcopy(h.state_dict())
    h2 = ReduceLROnPlateauHook("val/bce", optimizer=opt)
    h2.load_state_dict(state)
    assert h2.state_dict() == state and opt.param_groups[0]["lr"] == pytest.approx(0.1)
    hmax = ReduceLROnPlateauHook("auc", mode="max", patience=0, optimizer=opt)
    assert [hmax.step(v) for v in (0.5, 0.6, 0.6)] == [False, False, True]
    with pytest.raises(ValueError):
        ReduceLROnPlateauHook(mode="median")
