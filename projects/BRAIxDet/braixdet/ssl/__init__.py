"""Student-teacher SSL pieces: EMA teacher and BN modes and Algorithm 2 (pseudo-labels), paper
§3.2-3.3. Algorithm 1 (GradCAM pseudo-boxes of the classifier) is braixdet/cam.py."""
from .ema import BN_MODES, apply_bn_mode, build_teacher, check_bn_mode, ema_update, unwrap
from .pseudo_labels import (
    cam_phase_active,
    fuse_teacher_and_cam,
    fusion_iters_from_cfg,
    make_pseudo_targets,
    teacher_top1,
)

__all__ = [
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
