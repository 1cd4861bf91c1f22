"""EMA teacher, BN modes (frozen/open/ema), DDP EMA and Algorithm 2 pseudo-labels."""
import os
from datetime import timedelta

import pytest
import torch
from detectron2.structures import Boxes, Instances
from timm.layers import BatchNormAct2d
from torch import nn

from braixdet.ssl import (
    apply_bn_mode,
    build_teacher,
    cam_phase_active,
    ema_update,
    fuse_teacher_and_cam,
    fusion_iters_from_cfg,
    make_pseudo_targets,
    teacher_top1,
    unwrap,
)
from braixdet.ssl.ema import bn_layers_in_train_mode
from braixdet.utils.runtime import end_distributed

ALPHA = 0.9


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn_act = BatchNormAct2d(4)  # timm's, a BatchNorm2d subclass
        self.fc = nn.Linear(4, 1)
        self.register_buffer("pixel_mean", torch.tensor([0.5]))  # a non-BN constant buffer

    def forward(self, x):
        x = self.bn_act(self.bn(self.conv(x - self.pixel_mean)))
        return self.fc(x.mean((2, 3)))


def _bn_stats(model):
    return {k: v.clone() for k, v in model.state_dict().items()
            if "running_" in k or "num_batches" in k}


def _params(model):
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _train_steps(student, teacher, mode, n=3, seed=0):
    """SGD steps with EMA after each; checks the parameter EMA formula every step."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    student.train()
    apply_bn_mode(student, teacher, mode)
    for _ in range(n):
        x = torch.randn(4, 1, 8, 8, generator=g) * 3 + 1
        loss = student(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t_before, s_now = _params(teacher), _params(unwrap(student))
        ema_update(teacher, student, ALPHA, mode)
        for k, t in teacher.named_parameters():
            expected = ALPHA * t_before[k] + (1 - ALPHA) * s_now[k]
            torch.testing.assert_close(t.detach(), expected, rtol=0, atol=1e-7)
        # the update was not trivial (the conv bias before a training-mode BN gets no gradient)
        assert not torch.equal(t_before["fc.weight"], s_now["fc.weight"])
        assert not torch.equal(t_before["conv.weight"], s_now["conv.weight"])


def _setup(mode):
    torch.manual_seed(0)
    student = TinyNet()
    with torch.no_grad():  # non-trivial pre-training statistics
        student.bn.running_mean.uniform_(-1, 1)
        student.bn.running_var.uniform_(0.5, 2)
    teacher = build_teacher(student)
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    return student, teacher


def test_ema_frozen_bn():
    student, teacher = _setup("frozen")
    s0, t0 = _bn_stats(student), _bn_stats(teacher)
    w0 = student.bn.weight.detach().clone()
    _train_steps(student, teacher, "frozen")
    assert student.training and bn_layers_in_train_mode(student) == []
    for k in s0:  # statistics fixed in both models
        assert torch.equal(_bn_stats(student)[k], s0[k]), k
        assert torch.equal(_bn_stats(teacher)[k], t0[k]), k
    assert not torch.equal(student.bn.weight, w0)  # affine parameters still train
    assert not teacher.training


def test_ema_open_bn():
    student, teacher = _setup("open")
    s0, t0 = _bn_stats(student), _bn_stats(teacher)
    _train_steps(student, teacher, "open")
    assert set(bn_layers_in_train_mode(student)) == {"bn", "bn_act"}
    s1, t1 = _bn_stats(student), _bn_stats(teacher)
    for k in s0:
        assert not torch.equal(s1[k], s0[k]), k  # student updates its statistics
        assert torch.equal(t1[k], t0[k]), k  # the teacher keeps its own


def test_ema_bn_statistics():
    student, teacher = _setup("ema")
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(student.parameters(), lr=0.1)
    student.train()
    apply_bn_mode(student, teacher, "ema")
    for _ in range(3):
        loss = student(torch.randn(4, 1, 8, 8, generator=g) * 2).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t_prev, s_now = _bn_stats(teacher), _bn_stats(student)
        ema_update(teacher, student, ALPHA, "ema")
        t_new = _bn_stats(teacher)
        for k in t_prev:
            if k.endswith("num_batches_tracked"):
                assert int(t_new[k]) == int(s_now[k]) > 0
            else:
                exp = ALPHA * t_prev[k] + (1 - ALPHA) * s_now[k]
                torch.testing.assert_close(t_new[k], exp, rtol=0, atol=1e-7)
                assert not torch.equal(t_new[k], t_prev[k])


def test_bn_mode_validation_and_constant_buffers():
    student, teacher = _setup("frozen")
    with pytest.raises(ValueError, match="BN mode"):
        ema_update(teacher, student, 0.99, "freeze")
    with pytest.raises(ValueError, match="BN mode"):
        apply_bn_mode(student, teacher, "EMA")
    student.pixel_mean.fill_(0.25)  # constants follow the student
    ema_update(teacher, student, 0.99, "frozen")
    assert float(teacher.pixel_mean) == 0.25
    with pytest.raises(ValueError, match="differ"):
        ema_update(nn.Linear(2, 2), student)


# ---------------------------------------------------------------- DDP (2 CPU processes, gloo)
def _ddp_worker(out_dir):
    import torch.distributed as dist
    from detectron2.utils import comm

    torch.set_num_threads(1)
    rank = comm.get_rank()
    torch.manual_seed(0)  # same initial model on every rank
    student = nn.parallel.DistributedDataParallel(TinyNet(), device_ids=None)
    teacher = build_teacher(student)
    assert not isinstance(teacher, nn.parallel.DistributedDataParallel)
    opt = torch.optim.SGD(student.parameters(), lr=0.5)
    student.train()
    apply_bn_mode(student, teacher, "frozen")
    g = torch.Generator().manual_seed(100 + rank)  # different data per rank
    for _ in range(2):
        loss = student(torch.randn(2, 1, 8, 8, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        t_before, s_now = _params(teacher), _params(student.module)
        ema_update(teacher, student, ALPHA, "frozen")
        for k, t in teacher.named_parameters():
            exp = ALPHA * t_before[k] + (1 - ALPHA) * s_now[k]
            torch.testing.assert_close(t.detach(), exp, rtol=0, atol=1e-7)
    dist.barrier()
    torch.save(teacher.state_dict(), os.path.join(out_dir, f"teacher{rank}.pt"))

    # The trainer's finite-loss check in the same setting: a NaN on rank 1 stops every rank
    # (instead of rank 0 hanging in the next gradient all-reduce).
    from braixdet.engine.hooks import check_finite_losses

    try:
        check_finite_losses({"loss_cls": torch.tensor(float("nan") if rank else 0.5)}, 9)
        msg = "no error"
    except FloatingPointError as e:
        msg = str(e)
    with open(os.path.join(out_dir, f"finite{rank}.txt"), "w") as f:
        f.write(msg)
    end_distributed()
    # without the interpreter's teardown, where a gloo rank was seen to abort now and then
    # (test_evaluation_distributed.py says more); everything this test reads is written
    os._exit(0)


def test_ema_ddp_student_identical_teachers(tmp_path):
    from detectron2.engine import launch

    launch(_ddp_worker, 2, dist_url="auto", args=(str(tmp_path),), timeout=timedelta(minutes=2))
    t0 = torch.load(tmp_path / "teacher0.pt", weights_only=True)
    t1 = torch.load(tmp_path / "teacher1.pt", weights_only=True)
    ref = build_teacher(_setup("frozen")[0]).state_dict()
    for k in t0:
        assert torch.equal(t0[k], t1[k]), k
    assert not torch.equal(t0["conv.weight"], ref["conv.weight"])  # it was updated
    prefix = "Loss became infinite or NaN at iteration=9: "
    assert (tmp_path / "finite1.txt").read_text() == prefix + "loss_cls=nan"
    assert (tmp_path / "finite0.txt").read_text().startswith(prefix + "on another rank")


# ---------------------------------------------------------------- Algorithm 2
SIZE = (128, 64)


def _teacher(boxes, scores):
    inst = Instances(SIZE)
    inst.pred_boxes = Boxes(torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4))
    inst.scores = torch.tensor(scores, dtype=torch.float32)
    return inst


def _inp(image_id, label):
    return {"image": torch.zeros(1, *SIZE), "label": label, "image_id": image_id}


def test_teacher_top1_and_threshold():
    inst = _teacher([[0, 0, 10, 10], [20, 20, 40, 40], [5, 5, 9, 9]], [0.3, 0.8, 0.5])
    b, s = teacher_top1(inst)
    assert b.tolist() == [[20, 20, 40, 40]] and s.tolist() == pytest.approx([0.8])
    b, s = teacher_top1(inst, score_thresh=0.9)
    assert b.shape == (0, 4) and s.shape == (0,)
    b, s = teacher_top1(_teacher([], []))
    assert b.shape == (0, 4)


def test_fuse_overlapping_and_disjoint():
    t_b, t_s = torch.tensor([[10.0, 10, 50, 50]]), torch.tensor([0.9])
    # overlapping CAM box (IoU 0.64 > 0.2) with lower score: the teacher's box survives
    b, s = fuse_teacher_and_cam(t_b, t_s, [[12.0, 12, 52, 52]], [0.6])
    assert b.tolist() == [[10, 10, 50, 50]] and s.tolist() == pytest.approx([0.9])
    # overlapping CAM box with a higher score wins
    b, s = fuse_teacher_and_cam(t_b, torch.tensor([0.3]), [[12.0, 12, 52, 52]], [0.6])
    assert b.tolist() == [[12, 12, 52, 52]]
    # disjoint: both kept, sorted by score
    b, s = fuse_teacher_and_cam(t_b, t_s, [[60.0, 70, 63, 90]], [0.95])
    assert b.tolist() == [[60, 70, 63, 90], [10, 10, 50, 50]]
    # low overlap (IoU 100/3100 ≈ 0.032 < τ=0.2) keeps both; a smaller τ suppresses
    b, _ = fuse_teacher_and_cam(t_b, t_s, [[40.0, 40, 80, 80]], [0.5], nms_thresh=0.2)
    assert len(b) == 2
    b, _ = fuse_teacher_and_cam(t_b, t_s, [[40.0, 40, 80, 80]], [0.5], nms_thresh=0.03)
    assert len(b) == 1


def test_make_pseudo_targets_cases():
    cam = {
        "a": (torch.tensor([[12.0, 12, 52, 52], [40, 90, 60, 120]]), torch.tensor([0.6, 0.7])),
        "c": (torch.tensor([[1.0, 1, 30, 30]]), torch.tensor([0.4])),
    }
    outs = [
        _teacher([[10, 10, 50, 50], [0, 0, 5, 5]], [0.9, 0.2]),  # a: overlap + disjoint CAM
        {"instances": _teacher([], [])},  # b: empty teacher, no CAM -> None
        _teacher([], []),  # c: empty teacher, CAM only
        _teacher([[10, 10, 50, 200]], [0.7]),  # d: no CAM entry, box clipped to the image
        _teacher([[10, 10, 50, 50]], [0.9]),  # e: label 0
    ]
    inps = [_inp("a", 1), _inp("b", 1), _inp("c", 1), _inp("d", 1), _inp("e", 0)]
    stats = {}
    t = make_pseudo_targets(outs, inps, cam, use_cam=True, nms_thresh=0.2, stats=stats)
    assert t[0].gt_boxes.tensor.tolist() == [[10, 10, 50, 50], [40, 90, 60, 120]]
    assert t[0].gt_classes.dtype == torch.int64 and t[0].gt_classes.tolist() == [0, 0]
    assert t[0].image_size == SIZE
    assert t[1] is None
    assert t[2].gt_boxes.tensor.tolist() == [[1, 1, 30, 30]]
    assert t[3].gt_boxes.tensor.tolist() == [[10, 10, 50, 128]]
    assert len(t[4]) == 0 and t[4].has("gt_boxes") and t[4].image_size == SIZE
    assert stats == {"teacher": 2, "cam": 3, "boxes": 4, "negative": 1, "skipped": 1}

    # after the CAM phase: teacher only; label 0 -> None when not background
    t = make_pseudo_targets(outs, inps, cam, use_cam=False, negative_as_background=False)
    assert t[0].gt_boxes.tensor.tolist() == [[10, 10, 50, 50]]
    assert t[2] is None and t[4] is None
    # score threshold drops the teacher's box, CAM still fused
    t = make_pseudo_targets(outs[:1], inps[:1], cam, use_cam=True, score_thresh=0.95)
    assert t[0].gt_boxes.tensor.tolist() == [[40, 90, 60, 120], [12, 12, 52, 52]]
    t = make_pseudo_targets(outs[:1], inps[:1], {}, use_cam=True, score_thresh=0.95)
    assert t == [None]


def test_cam_boxes_used_in_the_input_frame():
    # the trainer maps CAM boxes (preprocessing + augmentation); nothing is applied twice here
    from detectron2.data.transforms import VFlipTransform

    inp = dict(_inp("c", 1), aug_transforms=VFlipTransform(SIZE[0]))
    cam = {"c": ([[1.0, 98, 30, 127]], [0.4])}
    t = make_pseudo_targets([_teacher([], [])], [inp], cam, use_cam=True)
    assert t[0].gt_boxes.tensor.tolist() == [[1, 98, 30, 127]]


def test_fusion_iters():
    assert fusion_iters_from_cfg(100, 8) == 25  # ceil(2 * 100 / 8)
    assert fusion_iters_from_cfg(101, 8) == 26
    assert fusion_iters_from_cfg(30, 3, epochs=0.1) == 1
    assert fusion_iters_from_cfg(100, 8, epochs=0) == 0
    assert fusion_iters_from_cfg(100, 8, override_iters=7) == 7
    assert fusion_iters_from_cfg(100, 8, override_iters=0) == 0
    with pytest.raises(ValueError):
        fusion_iters_from_cfg(100, 0)
    assert cam_phase_active(24, 25) and not cam_phase_active(25, 25)
    assert not cam_phase_active(0, 0)
