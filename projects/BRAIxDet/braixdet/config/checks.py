"""Every check of a config's values, run once by ``build_cfg`` before anything is read or written.

A bad value such as ``SOLVER.IMS_PER_BATCH 0``, ``DATASETS.BRAIXDET.RATIO 1/0`` or
``VAL_FRACTION 1.5`` ends with ``error: SOLVER.IMS_PER_BATCH = 0: allowed: an integer >= 1``
instead of a traceback hours later (or, for VAL_FRACTION, an empty training split and a silent
exit 0); a detectron2 key BRAIxDet does not honour (defaults.UNSUPPORTED_KEYS) is refused the
same way. The trainers, the data path and the model read values that passed here.
"""
import math
import numbers

from detectron2.config import get_cfg

from ..cam import METHODS, TARGET_LAYERS
from ..data.datasets import LOADERS
from ..data.protocols import PROTOCOLS, TEST_IMAGES, parse_ratio
from ..ssl.box_sources import CAM_BOX_SOURCES
from ..ssl.competitors import PSEUDO_LABEL_MODES, STRONG_AUG_POLICIES
from ..ssl.ema import BN_MODES
from .defaults import D2_INPUT_KEYS, UNSUPPORTED_KEYS, add_braixdet_config

__all__ = ["ConfigValueError", "check_config", "check_module_keys", "OPTIMIZERS"]

OPTIMIZERS = ("ADAM", "SGD")  # SOLVER.BRAIXDET.OPTIMIZER, any case (engine/trainers.py)


class ConfigValueError(ValueError):
    """A config value outside what BRAIxDet accepts; ``str`` is the one-line message."""

    def __init__(self, key, value, allowed, message=""):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(message or f"{key} = {value!r}: allowed: {allowed}")


def _int_at_least(lo):
    def ok(v):
        return isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= lo
    return ok, f"an integer >= {lo}"


def _number_in(lo, hi, lo_open=False, hi_open=False):
    def ok(v):
        if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
            return False
        return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
    return ok, (f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


def _one_of(*values):
    return (lambda v: v in values), "one of " + ", ".join(repr(v) for v in values)


def _ratio():
    def ok(v):
        try:
            parse_ratio(v)
        except (ValueError, ZeroDivisionError, TypeError):
            return False
        return True
    return ok, "a fraction in (0, 1] such as '1/8' or 0.125"


def _canonical_size():
    def ok(v):
        return (isinstance(v, (list, tuple)) and len(v) == 2 and all(
            isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 32 and x % 2 == 0
            for x in v))
    return ok, "(H, W): two even integers >= 32"


_CHECKS = {
    "NUM_THREADS": _int_at_least(0),
    "SOLVER.IMS_PER_BATCH": _int_at_least(1),
    "SOLVER.BASE_LR": _number_in(0, math.inf, lo_open=True, hi_open=True),
    "MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT": _number_in(0, math.inf, hi_open=True),
    "SOLVER.BRAIXDET.OPTIMIZER": (lambda v: str(v).upper() in OPTIMIZERS, "ADAM or SGD"),
    "SOLVER.BRAIXDET.EPOCHS": _number_in(0, math.inf, lo_open=True, hi_open=True),
    "SOLVER.BRAIXDET.AMP_DTYPE": _one_of("auto", "bf16", "fp16"),
    "SOLVER.BRAIXDET.CHECKPOINTS_KEPT": _int_at_least(0),
    "DATALOADER.NUM_WORKERS": _int_at_least(0),
    "DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH": _int_at_least(1),
    "DATASETS.BRAIXDET.FORMAT": _one_of(*sorted(LOADERS)),
    "DATASETS.BRAIXDET.PROTOCOL": _one_of(*PROTOCOLS),
    "DATASETS.BRAIXDET.RATIO": _ratio(),  # read by the partial protocol only
    "DATASETS.BRAIXDET.VAL_FRACTION": _number_in(0, 1, hi_open=True),  # 0: no validation
    "DATASETS.BRAIXDET.TEST_IMAGES": _one_of(*TEST_IMAGES),
    "DATASETS.BRAIXDET.ON_BAD_INPUT": _one_of("skip", "error"),
    "DATASETS.BRAIXDET.SEED": _int_at_least(0),
    "INPUT.BRAIXDET.CANONICAL_SIZE": _canonical_size(),
    "INPUT.BRAIXDET.MASK_MARGIN": _number_in(0, 1),
    "INPUT.BRAIXDET.MASK_DOWNSAMPLE": _int_at_least(1),
    "INPUT.BRAIXDET.CACHE_FORMAT": _one_of("npy", "png"),
    "MODEL.BRAIXDET.LCM.CROSS_VIEW_INIT_GAIN": _number_in(0, math.inf, hi_open=True),
    "MODEL.BRAIXDET.LCM.LR_FACTOR": _number_in(0, math.inf, lo_open=True, hi_open=True),
    "MODEL.BRAIXDET.CAM.METHOD": _one_of(*METHODS),
    "MODEL.BRAIXDET.CAM.TARGET_LAYER": _one_of(*TARGET_LAYERS),
    "MODEL.BRAIXDET.CAM.TAU": _number_in(0, 1, lo_open=True, hi_open=True),
    "SSL.EMA_ALPHA": _number_in(0, 1),
    "SSL.CAM_VIEW_AGREEMENT": _number_in(0, 1, hi_open=True),
    "SSL.CAM_BOX_SOURCE": _one_of(*CAM_BOX_SOURCES),
    "SSL.LAMBDA_WEAK": _number_in(0, math.inf, hi_open=True),
    "SSL.BN_MODE": _one_of(*BN_MODES),
    "SSL.PSEUDO_LABELS": _one_of(*PSEUDO_LABEL_MODES),
    "SSL.STRONG_AUG_POLICY": _one_of(*sorted(STRONG_AUG_POLICIES)),
}


def _get(cfg, key):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _plain(value):
    return tuple(value) if isinstance(value, (list, tuple)) else value


def _check_supported_keys(cfg):
    for key, (value, why) in UNSUPPORTED_KEYS.items():
        got = _get(cfg, key)
        if _plain(got) != value:
            raise ConfigValueError(key, got, repr(value), message=(
                f"{key} = {got!r} is not supported by BRAIxDet ({why}); leave it at {value!r}"))
    d2 = get_cfg().INPUT
    for key in D2_INPUT_KEYS:
        got, default = _get(cfg.INPUT, key), _get(d2, key)
        if _plain(got) != _plain(default):
            raise ConfigValueError(f"INPUT.{key}", got, repr(default), message=(
                f"INPUT.{key} = {got!r} is not used by BRAIxDet: images are canonicalised by "
                "INPUT.BRAIXDET.* (CANONICAL_SIZE, AUG.*)"))


def _check_lcm_extra_features(cfg):
    b = cfg.MODEL.BRAIXDET
    extra = list(b.LCM.EXTRA_FEATURES)
    if not extra:
        return
    key = "MODEL.BRAIXDET.LCM.EXTRA_FEATURES"
    if not (b.MULTI_VIEW and b.LCM.ENABLED and cfg.MODEL.META_ARCHITECTURE == "MultiViewRCNN"):
        # the classifier's head reads res5 alone: an attention on another stage would not train
        raise ConfigValueError(key, extra, "[] unless the model is a multi-view detector with "
                               "the LCM enabled (MultiViewRCNN, MULTI_VIEW, LCM.ENABLED)")
    allowed = [f for f in b.OUT_FEATURES if f != "res5"]
    if len(set(extra)) != len(extra) or not set(extra) <= set(allowed):
        raise ConfigValueError(key, extra, f"distinct stages of MODEL.BRAIXDET.OUT_FEATURES "
                               f"other than res5 (which the LCM always fuses): {allowed}")


def _check_cls_head_reads_aux(cfg):
    b = cfg.MODEL.BRAIXDET
    if not b.CLS_HEAD_READS_AUX and not (
            cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier" and b.MULTI_VIEW
            and b.LCM.ENABLED and not b.GCM.ENABLED):
        raise ConfigValueError("MODEL.BRAIXDET.CLS_HEAD_READS_AUX", False, (
            "True unless the model is the multi-view classifier with the LCM enabled and "
            "GCM.ENABLED False (its global feature reads the aux view)"))


def _braixdet_detector(cfg):
    """MultiViewRCNN on the two-view FPN: the model whose builder reads the DET_* options."""
    return (cfg.MODEL.META_ARCHITECTURE == "MultiViewRCNN"
            and cfg.MODEL.BACKBONE.NAME == "build_braixdet_fpn_backbone")


def _check_det_reads_aux_global(cfg):
    b = cfg.MODEL.BRAIXDET
    if b.DET_READS_AUX_GLOBAL and not (b.MULTI_VIEW and _braixdet_detector(cfg)):
        raise ConfigValueError("MODEL.BRAIXDET.DET_READS_AUX_GLOBAL", True, (
            "False unless the model is a multi-view detector (MultiViewRCNN, MULTI_VIEW, "
            "MODEL.BACKBONE.NAME build_braixdet_fpn_backbone)"))


def _check_det_image_loss(cfg):
    b = cfg.MODEL.BRAIXDET
    detector = _braixdet_detector(cfg)
    if b.DET_IMAGE_LOSS_WEIGHT > 0 and not detector:
        raise ConfigValueError("MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT", b.DET_IMAGE_LOSS_WEIGHT, (
            "0 unless the model is a detector (MultiViewRCNN with MODEL.BACKBONE.NAME "
            "build_braixdet_fpn_backbone); the classifier's own head is trained on the label"))
    if b.DET_IMAGE_LOSS_WEIGHT > 0 and cfg.SSL.SOFT_TEACHER:
        # soft_teacher_losses runs the student's parts itself, not its forward
        raise ConfigValueError("MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT", b.DET_IMAGE_LOSS_WEIGHT,
                               "0 with SSL.SOFT_TEACHER (its weak-image losses bypass the "
                               "image head)")
    if cfg.TEST.BRAIXDET.IMAGE_SCORE_GATE and not (detector and b.DET_IMAGE_LOSS_WEIGHT > 0):
        raise ConfigValueError("TEST.BRAIXDET.IMAGE_SCORE_GATE", True, (
            "False unless MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT > 0 trains the detector's "
            "image head"))


def _check_paired_view_rescore(cfg):
    if cfg.TEST.BRAIXDET.PAIRED_VIEW_RESCORE and cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier":
        # the classifier's evaluator scores images, not boxes
        raise ConfigValueError("TEST.BRAIXDET.PAIRED_VIEW_RESCORE", True,
                               "False unless the model is a detector")


def _view_modules(cfg):
    """{config node: why the model builds none of it ("" when it does), whether its ENABLED
    switch acts}: a switch acts where the architecture has the module, even when off."""
    b = cfg.MODEL.BRAIXDET
    if not b.MULTI_VIEW:
        lcm = gcm = ("MODEL.BRAIXDET.MULTI_VIEW False", False)
    else:
        lcm = ("" if b.LCM.ENABLED else "LCM.ENABLED False", True)
        gcm = ("" if b.GCM.ENABLED else "GCM.ENABLED False", True)
        if cfg.MODEL.META_ARCHITECTURE != "MVCCLClassifier":
            gcm = ("a detector: the paper prunes the GCM, §3.2", False)
    return {"LCM": lcm, "GCM": gcm}


def check_module_keys(cfg):
    """Refuse an LCM.* or GCM.* value other than its default where the model does not build
    that module (it would do nothing). Checked before training, not by ``check_config``: a
    saved config of a single-view run from before this check may carry the demo's LCM widths,
    and inference must still read it."""
    defaults = get_cfg()
    add_braixdet_config(defaults)
    for node, (why, switch_acts) in _view_modules(cfg).items():
        if not why:
            continue
        for leaf, default in defaults.MODEL.BRAIXDET[node].items():
            if leaf == "ENABLED" and switch_acts:
                continue
            key = f"MODEL.BRAIXDET.{node}.{leaf}"
            got = _get(cfg, key)
            if _plain(got) != _plain(default):
                raise ConfigValueError(key, got, repr(default), message=(
                    f"{key} = {got!r} does nothing: this model has no {node} ({why}); "
                    f"leave it at {default!r}"))


def check_config(cfg):
    """Raise ConfigValueError (one line: key, value, what is allowed) for the first value
    BRAIxDet does not accept; returns ``cfg``."""
    _check_supported_keys(cfg)
    for key, (ok, allowed) in _CHECKS.items():
        if key == "DATASETS.BRAIXDET.RATIO" and cfg.DATASETS.BRAIXDET.PROTOCOL != "partial":
            continue
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigValueError(key, value, allowed)
    _check_lcm_extra_features(cfg)
    _check_cls_head_reads_aux(cfg)
    _check_det_reads_aux_global(cfg)
    _check_det_image_loss(cfg)
    _check_paired_view_rescore(cfg)
    if cfg.SSL.STRONG_AUG_LABELLED and not cfg.SSL.STRONG_AUG:
        raise ConfigValueError("SSL.STRONG_AUG_LABELLED", True, "False unless SSL.STRONG_AUG "
                               "is True (the labelled copy uses the strong augmentation)")
    return cfg
