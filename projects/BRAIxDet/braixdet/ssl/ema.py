"""Mean-teacher EMA and the batch-norm modes of BRAIxDet (paper §3.2-3.3, docs/DESIGN.md §4).

Usage in a trainer (one iteration)::

    student.train(); apply_bn_mode(student, teacher, bn_mode)   # once, after every .train()
    ... loss.backward(); optimizer.step()
    ema_update(teacher, student, alpha, bn_mode)                # every iteration, all ranks

BN modes:
  * ``frozen`` (paper, default): BN running statistics from pre-training stay fixed in both
    models: student BN layers run in eval mode (affine weights still train), teacher untouched.
  * ``open``: the student updates its statistics (BN in train mode); the teacher keeps its own.
  * ``ema``: the student updates its statistics; the teacher's are the EMA of the student's
    (Cai et al. 2021, "exponential moving average normalization").
"""
import copy

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..utils.modules import unwrap

__all__ = ["BN_MODES", "unwrap", "build_teacher", "apply_bn_mode", "ema_update", "check_bn_mode",
           "bn_layers_in_train_mode", "ema_momentum"]

BN_MODES = ("frozen", "open", "ema")
# Buffers of BatchNorm layers that are statistics (the rest of the buffers are constants).
_BN_STATS = ("running_mean", "running_var")


def check_bn_mode(mode):
    if mode not in BN_MODES:
        raise ValueError(f"Unknown BN mode {mode!r}; expected one of {BN_MODES} (cfg SSL.BN_MODE)")
    return mode


def _bn_modules(model):
    # _BatchNorm covers BatchNorm1d/2d/3d, SyncBatchNorm and timm's BatchNormAct2d (a
    # BatchNorm2d subclass). detectron2's FrozenBatchNorm2d only holds constant buffers.
    return [m for m in model.modules() if isinstance(m, _BatchNorm)]


def build_teacher(student):
    """Teacher = a deep copy of the (unwrapped) initialised student; eval mode, no gradients."""
    teacher = copy.deepcopy(unwrap(student))
    teacher.eval()
    teacher.requires_grad_(False)
    return teacher


def apply_bn_mode(student, teacher=None, mode="frozen"):
    """Set train/eval modes of BN layers. Call right after ``student.train()`` (which puts
    every BN back into train mode) and after anything else that changes modes.

    ``frozen``: student BN layers in eval mode (running statistics are used and not updated;
    their affine weight/bias still get gradients). ``open``/``ema``: student BN layers follow the
    student's mode. The teacher is always in eval mode with ``requires_grad=False``.
    """
    check_bn_mode(mode)
    student = unwrap(student)
    for m in _bn_modules(student):
        m.train(student.training and mode != "frozen")
    if teacher is not None:
        teacher = unwrap(teacher)
        teacher.eval()
        teacher.requires_grad_(False)
    return student


def _bn_buffer_kinds(model):
    """{buffer name: "stat" | "count"} for the statistics buffers of BN layers."""
    kinds = {}
    for mname, m in model.named_modules():
        if isinstance(m, _BatchNorm):
            prefix = f"{mname}." if mname else ""
            for b in _BN_STATS:
                kinds[prefix + b] = "stat"
            kinds[prefix + "num_batches_tracked"] = "count"
    return kinds


def _matched(teacher_items, student_items, what):
    t, s = dict(teacher_items), dict(student_items)
    if t.keys() != s.keys():
        diff = sorted(set(t) ^ set(s))[:5]
        raise ValueError(f"Teacher and student {what} differ (e.g. {diff}); was the teacher "
                         "built with build_teacher(student)?")
    return [(k, t[k], s[k]) for k in t]


@torch.no_grad()
def ema_update(teacher, student, alpha=0.999, bn_mode="frozen"):
    """In place: θ_t ← α θ_t + (1−α) θ_s for every parameter (trainable or not).

    ``student`` may be DDP/DataParallel-wrapped; its parameters are identical on every rank after
    the synchronised optimizer step, so calling this on every rank keeps the teachers identical.
    Buffers: BN ``running_mean``/``running_var`` are untouched in ``frozen`` (they equal the
    student's, which are fixed) and ``open`` (the teacher keeps its own), and the EMA of the
    student's in ``ema``; ``num_batches_tracked`` is copied in ``ema``. Other buffers (constants
    such as pixel_mean or FrozenBatchNorm2d statistics) are copied from the student.
    """
    check_bn_mode(bn_mode)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"EMA alpha must be in [0, 1], got {alpha}")
    teacher, student = unwrap(teacher), unwrap(student)

    params = _matched(teacher.named_parameters(), student.named_parameters(), "parameters")
    t_params = [t for _, t, _ in params]
    s_params = [s.detach().to(t.dtype) for _, t, s in params]
    if t_params:
        # Same arithmetic as α*t + (1−α)*s, batched over tensors.
        torch._foreach_mul_(t_params, alpha)
        torch._foreach_add_(t_params, s_params, alpha=1.0 - alpha)

    kinds = _bn_buffer_kinds(teacher)
    for name, t, s in _matched(teacher.named_buffers(), student.named_buffers(), "buffers"):
        kind = kinds.get(name)
        if kind is None:
            t.copy_(s)
        elif bn_mode == "ema":
            if kind == "stat":
                t.mul_(alpha).add_(s.to(t.dtype), alpha=1.0 - alpha)
            else:
                t.copy_(s)
        # frozen / open: teacher BN statistics untouched.
    return teacher


def ema_momentum(alpha, iteration, ramp=False):
    """The EMA momentum after the 0-based training ``iteration``: ``alpha``, or with ``ramp``
    min(alpha, 1 − 1/(iteration + 2)), microsoft/SoftTeacher's MeanTeacher hook with warm_up 0
    (it updates before its step s = iteration + 1 with min(alpha, 1 − 1/(s + 1))): the teacher
    starts as the average of the student's first steps, not as a slow copy of the first one."""
    if not ramp:
        return alpha
    return min(alpha, 1.0 - 1.0 / (iteration + 2))


def bn_layers_in_train_mode(model: nn.Module):
    """Names of BN layers currently in train mode (debug helper: empty under ``frozen``)."""
    return [n for n, m in unwrap(model).named_modules() if isinstance(m, _BatchNorm) and m.training]
