"""Training-loop helpers: a finite-loss check, ReduceLROnPlateau, the best-model export and
the checkpoint after the final evaluation.

Wiring (the trainer's side):

* ``FiniteLossCheck`` — in ``run_step``, after the forward pass and BEFORE ``backward()``::

      self.finite_check(loss_dict, self.iter)   # FloatingPointError naming iteration and term

  so a NaN/inf never reaches the weights. With several processes the flag is all-reduced so
  that every rank raises together instead of hanging in DDP's gradient all-reduce.

* ``ReduceLROnPlateauHook`` — register AFTER the ``EvalHook`` that writes the metric (so it sees
  the value in the same ``after_step``, and the final one, which ``EvalHook`` runs in
  ``after_train``, in its own ``after_train``) and BEFORE the ``PeriodicCheckpointer`` (so a
  checkpoint taken at an evaluation iteration already contains the reduced lr and the hook's
  state). Keep detectron2's ``LRScheduler`` hook (any closed-form schedule over ``base_lrs``,
  e.g. ``WarmupMultiStepLR`` with ``SOLVER.STEPS=()`` = warmup then constant). On a reduction the
  hook multiplies, per param group, the optimizer's ``lr`` (and ``initial_lr``) and the
  scheduler's ``base_lrs`` by ``factor``: the scheduler keeps producing ``base_lr × schedule(t)``
  and the reduction persists. Resume is exact because the reduced values live in the optimizer
  and scheduler state dicts (DefaultTrainer checkpoints both through ``trainer``) and the hook's
  own bookkeeping (best, bad evaluations, reductions) is saved by
  ``TrainerBase.state_dict()["hooks"]``; loading it never re-applies a reduction.

* ``FinalEvaluationCheckpointer`` — register last: the final evaluation comes after the last
  periodic checkpoint, so a finished run saves ``model_final`` once more with its outcome.
"""
import logging
import math
import os
import resource
import time

import detectron2.utils.comm as comm
import torch
from detectron2.engine.hooks import LRScheduler as LRSchedulerHook
from detectron2.engine.train_loop import HookBase

from ..utils.checkpoint import atomic_torch_save, safe_torch_load
from ..utils.io import atomic_write_json
from ..utils.runtime import cpu_seconds

__all__ = ["BestExportHook", "FiniteLossCheck", "ReduceLROnPlateauHook", "TrainingTimeHook",
           "check_finite_losses"]

logger = logging.getLogger(__name__)


def _value(v):
    if isinstance(v, torch.Tensor):
        return v.detach().float().cpu().reshape(-1)
    return torch.tensor([float(v)])


def check_finite_losses(loss_dict, iteration, sync=None):
    """Raise FloatingPointError when any loss term is NaN/inf, naming the iteration and the term.

    ``sync`` (default: world size > 1) all-reduces a "bad" flag so that every rank raises.
    """
    bad = []
    for term, v in loss_dict.items():
        val = _value(v)
        if not bool(torch.isfinite(val).all()):
            bad.append(f"{term}={val.item() if val.numel() == 1 else val.tolist()}")
    if sync is None:
        sync = comm.get_world_size() > 1
    if sync:
        import torch.distributed as dist

        dev = next((v.device for v in loss_dict.values() if isinstance(v, torch.Tensor)), "cpu")
        flag = torch.tensor([1.0 if bad else 0.0], device=dev)
        dist.all_reduce(flag)
        if flag.item() > 0 and not bad:
            raise FloatingPointError(
                f"Loss became infinite or NaN at iteration={iteration}: on another rank "
                f"(this is rank {comm.get_rank()})")
    if bad:
        raise FloatingPointError(
            f"Loss became infinite or NaN at iteration={iteration}: {', '.join(bad)}")


class FiniteLossCheck:
    """Callable wrapper around :func:`check_finite_losses` (cfg SOLVER.BRAIXDET.CHECK_FINITE)."""

    def __init__(self, enabled=True, sync=None):
        self.enabled = enabled
        self.sync = sync

    def __call__(self, loss_dict, iteration):
        if self.enabled:
            check_finite_losses(loss_dict, iteration, sync=self.sync)


class ReduceLROnPlateauHook(HookBase):
    """PyTorch ReduceLROnPlateau semantics on evaluation results in ``trainer.storage``.

    After each evaluation (a new value of ``metric`` in the storage), the value counts as an
    improvement when it beats the best one by more than ``threshold`` (relative, like PyTorch's
    ``threshold_mode="rel"``); once the number of evaluations in a row without improvement
    exceeds ``patience`` (PyTorch's rule: patience=2 → the 3rd bad evaluation), every param
    group's lr is multiplied by ``factor`` and the count restarts. NaN values count as bad.

    ``metric``: a storage key, e.g. "classification/BCE"; when absent the match is
    case-insensitive on the key or its last "/" component ("bce" matches
    "classification/BCE"), preferring keys without a "student/" prefix, then the shortest.
    """

    def __init__(self, metric="bce", factor=0.1, patience=2, mode="min", threshold=0.0,
                 optimizer=None, scheduler=None):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        if not 0.0 < factor < 1.0:
            raise ValueError(f"factor must be in (0, 1), got {factor}")
        if patience < 0:
            raise ValueError(f"patience must be >= 0, got {patience}")
        self.metric = metric
        self.factor = float(factor)
        self.patience = int(patience)
        self.mode = mode
        self.threshold = float(threshold)
        self._optimizer = optimizer
        self._scheduler = scheduler
        self.best = math.inf if mode == "min" else -math.inf
        self.num_bad_evals = 0
        self.num_reductions = 0
        self.lr_scale = 1.0
        self.last_eval_iter = -1
        self.resolved_key = None
        self._warned = False

    # --- metric lookup -------------------------------------------------------------------
    def _find_key(self, latest):
        if self.metric in latest:
            return self.metric
        m = self.metric.lower()
        cands = [k for k in latest if k.lower() == m or k.lower().rsplit("/", 1)[-1] == m]
        if not cands:
            return None
        return sorted(cands, key=lambda k: (k.startswith("student/"), len(k), k))[0]

    def after_step(self):
        latest = self.trainer.storage.latest()
        key = self._find_key(latest)
        if key is None:
            return
        value, it = latest[key]
        if it <= self.last_eval_iter:
            return
        if self.resolved_key != key:
            logger.info(f"ReduceLROnPlateau follows metric '{key}' ({self.mode})")
            self.resolved_key = key
        self.last_eval_iter = int(it)
        self.step(float(value))

    def after_train(self):
        # the final evaluation runs in EvalHook.after_train: counted here, so that a finished
        # run extended later cuts the rate when an uninterrupted run would (RESULTS §36)
        if self.trainer.iter >= self.trainer.max_iter:
            self.after_step()

    # --- plateau logic -------------------------------------------------------------------
    def _is_better(self, value):
        if math.isnan(value):
            return False
        if math.isinf(self.best):  # first evaluation
            return True
        if self.mode == "min":
            return value < self.best - abs(self.best) * self.threshold
        return value > self.best + abs(self.best) * self.threshold

    def step(self, value):
        """Feed one evaluation result; returns True when the lr was reduced."""
        if self._is_better(value):
            self.best = float(value)
            self.num_bad_evals = 0
            return False
        self.num_bad_evals += 1
        if self.num_bad_evals > self.patience:
            self._reduce()
            self.num_bad_evals = 0
            return True
        return False

    def _get_optimizer(self):
        if self._optimizer is not None:
            return self._optimizer
        return self.trainer.optimizer

    def _get_scheduler(self):
        if self._scheduler is not None:
            return self._scheduler
        # The LRScheduler hook wraps a ParamScheduler into LRMultiplier in its before_train.
        trainer = getattr(self, "trainer", None)
        for h in getattr(trainer, "_hooks", []):
            sched = h.scheduler if isinstance(h, LRSchedulerHook) else None
            if isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
                return sched
        sched = getattr(trainer, "scheduler", None)
        return sched if isinstance(sched, torch.optim.lr_scheduler.LRScheduler) else None

    def _reduce(self):
        opt, sched = self._get_optimizer(), self._get_scheduler()
        for group in opt.param_groups:
            group["lr"] *= self.factor
            if "initial_lr" in group:
                group["initial_lr"] *= self.factor
        if sched is not None:
            sched.base_lrs = [lr * self.factor for lr in sched.base_lrs]
            if getattr(sched, "_last_lr", None) is not None:
                sched._last_lr = [lr * self.factor for lr in sched._last_lr]
        self.num_reductions += 1
        self.lr_scale *= self.factor
        trainer = getattr(self, "trainer", None)  # None when used without a trainer
        it = getattr(trainer, "iter", "?")
        logger.info(f"ReduceLROnPlateau: lr ×{self.factor} at iteration {it} (total scale "
                    f"{self.lr_scale:g}, best {self.metric}={self.best:g})")
        if trainer is not None:
            trainer.storage.put_scalar("lr_plateau_scale", self.lr_scale,
                                            smoothing_hint=False)

    # --- checkpointing -------------------------------------------------------------------
    def state_dict(self):
        return {
            "best": float(self.best),
            "num_bad_evals": int(self.num_bad_evals),
            "num_reductions": int(self.num_reductions),
            "lr_scale": float(self.lr_scale),
            "last_eval_iter": int(self.last_eval_iter),
        }

    def load_state_dict(self, state_dict):
        # Bookkeeping only: the reduced lrs come back with the optimizer/scheduler states.
        self.best = float(state_dict["best"])
        self.num_bad_evals = int(state_dict["num_bad_evals"])
        self.num_reductions = int(state_dict["num_reductions"])
        self.lr_scale = float(state_dict["lr_scale"])
        self.last_eval_iter = int(state_dict["last_eval_iter"])


class BestExportHook(HookBase):
    """Export the model users deploy at its best validation evaluation (paper: model selection
    on the validation set), atomically, to ``path`` as ``{"model": state_dict, "selected":
    {iteration, metric, value}}``; without validation, the last model at the end of training.

    Register AFTER the ``EvalHook`` (it reads the metric the evaluation just stored) and before
    the ``PeriodicCheckpointer`` (its bookkeeping is part of the checkpoint: exact resume).
    ``model_fn`` returns the module to export (the teacher for student-teacher training).
    """

    def __init__(self, path, model_fn, metric=None, mode="max"):
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.path, self._model_fn, self.metric, self.mode = path, model_fn, metric, mode
        self.best = None
        self.exported_iter = None
        self.last_eval_iter = None

    def _better(self, value):
        if math.isnan(value):
            return False
        if self.best is None:
            return True
        return value < self.best if self.mode == "min" else value > self.best

    def _export(self, iteration, value):
        if comm.is_main_process():
            selected = {"iteration": int(iteration), "metric": self.metric or "",
                        "value": None if value is None else float(value)}
            atomic_torch_save({"model": self._model_fn().state_dict(), "selected": selected},
                              self.path)
        self.exported_iter = int(iteration)

    def after_step(self):
        if self.metric is None:
            return
        latest = self.trainer.storage.latest()
        if self.metric not in latest:
            return
        value, it = latest[self.metric]
        if self.last_eval_iter is not None and it <= self.last_eval_iter:
            return
        self.last_eval_iter = int(it)
        if self._better(float(value)):
            self.best = float(value)
            self._export(it, value)

    def after_train(self):
        self.after_step()  # the final evaluation runs in EvalHook.after_train
        if self.trainer.iter < self.trainer.max_iter:
            # a failed or stopped run (after_train runs in a finally): it did not select a
            # "last model", and an export here would look like a finished stage
            return
        if self.exported_iter is None:
            self._export(self.trainer.iter, None)
        how = (f"best validation {self.metric} = {self.best:g}" if self.best is not None
               else "no validation metric: the last model")
        logger.info(f"Exported model: iteration {self.exported_iter} ({how}; last evaluation "
                    f"at iteration {self.last_eval_iter}) -> {self.path}")

    def state_dict(self):
        return {"best": self.best, "exported_iter": self.exported_iter,
                "last_eval_iter": self.last_eval_iter}

    def load_state_dict(self, state_dict):
        self.best = state_dict["best"]
        self.exported_iter = state_dict["exported_iter"]
        self.last_eval_iter = state_dict["last_eval_iter"]


class FinalEvaluationCheckpointer(HookBase):
    """Saves a finished run's ``model_final`` again after the final evaluation: detectron2's
    ``EvalHook`` runs it in ``after_train``, after the ``PeriodicCheckpointer`` saved the last
    step, so that checkpoint lacks the plateau and export decisions on it, and a run resumed
    with a longer schedule would forget its best evaluation and could export a worse model over
    it (RESULTS §35). Register after every hook whose state it saves; rank 0 only."""

    def __init__(self, checkpointer, name="model_final"):
        self.checkpointer, self.name = checkpointer, name

    def after_train(self):
        trainer = self.trainer
        if trainer.iter < trainer.max_iter:  # stopped or failed: its periodic checkpoints stand
            return
        finished = trainer.iter
        # the iteration the last step's checkpoint recorded: a resume starts right after it
        trainer.iter = trainer.max_iter - 1
        try:
            self.checkpointer.save(self.name, iteration=trainer.iter)
        finally:
            trainer.iter = finished


def read_export_selection(path):
    """The ``selected`` record a ``BestExportHook`` saved beside the weights in ``path``:
    {iteration, metric, value} (an empty dict for an export without one)."""
    return safe_torch_load(path).get("selected", {})


def _clocks():
    """Wall and CPU time now: this process's threads and its children that have ended."""
    return {"seconds": time.perf_counter(),
            "cpu_seconds": cpu_seconds(resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)}


class TrainingTimeHook(HookBase):
    """Carries a stage's run time across resumes: its state, saved in every checkpoint, is the
    wall and CPU time spent up to that checkpoint (this attempt's plus what the checkpoint it
    resumed from carried). At the start of training it writes what it carried in, the time of
    the earlier attempts, to ``OUTPUT_DIR/EARLIER_ATTEMPTS``: whoever times the stage's process
    adds it, so a row trained across sessions reports its whole cost, not its last segment.
    Counted for rank 0's process; time after the last checkpoint of a stopped attempt is lost
    work and is not counted."""

    EARLIER_ATTEMPTS = "earlier_attempts_time.json"

    def __init__(self, output_dir):
        self.output_dir = output_dir
        self.carried = {"seconds": 0.0, "cpu_seconds": 0.0}
        self._start = None

    def before_train(self):
        self._start = _clocks()
        if comm.is_main_process():
            atomic_write_json(os.path.join(self.output_dir, self.EARLIER_ATTEMPTS),
                              {"from_iteration": int(self.trainer.start_iter), **self.carried},
                              indent=1)

    def state_dict(self):
        if self._start is None:
            return dict(self.carried)
        now = _clocks()
        return {k: self.carried[k] + now[k] - self._start[k] for k in self.carried}

    def load_state_dict(self, state_dict):
        self.carried = {k: float(state_dict[k]) for k in self.carried}
