"""Student-teacher SSL pieces: EMA teacher and BN modes, Algorithm 1 (GradCAM pseudo-boxes) and
Algorithm 2 (pseudo-labels), paper §3.2-3.3."""
from .cam_boxes import CamSettings, load_cam_boxes, write_cam_boxes
from .ema import BN_MODES, apply_bn_mode, build_teacher, check_bn_mode, ema_update, unwrap
from .pseudo_labels import (
    cam_phase_active,
    fuse_teacher_and_cam,
    fusion_iters_from_cfg,
    make_pseudo_targets,
    teacher_top1,
)

__all__ = [
    "CamSettings",
    "load_cam_boxes",
    "write_cam_boxes",
    "BN_MODES",
    "apply_bn_mode",
    "build_teacher",
    "check_bn_mode",
    "ema_update",
    "unwrap",
    "cam_phase_active",
    "fuse_teacher_and_cam",
    "fusion_iters_from_cfg",
    "make_pseudo_targets",
    "teacher_top1",
]
