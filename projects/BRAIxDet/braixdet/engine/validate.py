"""Config values checked before anything is read or written: one line naming key, value, allowed.

``validate_config(cfg)`` runs in ``engine.setup.build_cfg`` (every tool), so a bad value such as
``SOLVER.IMS_PER_BATCH 0``, ``DATASETS.BRAIXDET.RATIO 1/0`` or ``VAL_FRACTION 1.5`` ends with
``error: SOLVER.IMS_PER_BATCH = 0: allowed: an integer >= 1`` instead of a traceback hours later
(or, for VAL_FRACTION, an empty training split and a silent exit 0).
"""
import math
import numbers

__all__ = ["ConfigValueError", "validate_config"]


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
    from ..data.protocols import parse_ratio

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


def _checks():
    from ..data.datasets import LOADERS
    from ..data.protocols import PROTOCOLS, TEST_IMAGES
    from ..ssl.cam_boxes import METHODS
    from ..ssl.competitors import STRONG_AUG_POLICIES
    from ..ssl.ema import BN_MODES

    return {
        "SOLVER.IMS_PER_BATCH": _int_at_least(1),
        "SOLVER.BASE_LR": _number_in(0, math.inf, lo_open=True, hi_open=True),
        "SOLVER.BRAIXDET.OPTIMIZER": (lambda v: str(v).upper() in ("ADAM", "SGD"),
                                      "ADAM or SGD"),
        "SOLVER.BRAIXDET.EPOCHS": _number_in(0, math.inf, lo_open=True, hi_open=True),
        "DATALOADER.NUM_WORKERS": _int_at_least(0),
        "DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH": _int_at_least(1),
        "DATASETS.BRAIXDET.FORMAT": _one_of(*sorted(LOADERS)),
        "DATASETS.BRAIXDET.PROTOCOL": _one_of(*PROTOCOLS),
        "DATASETS.BRAIXDET.RATIO": _ratio(),
        "DATASETS.BRAIXDET.VAL_FRACTION": _number_in(0, 1, hi_open=True),  # 0: no validation
        "DATASETS.BRAIXDET.TEST_IMAGES": _one_of(*TEST_IMAGES),
        "DATASETS.BRAIXDET.ON_BAD_INPUT": _one_of("skip", "error"),
        "DATASETS.BRAIXDET.SEED": _int_at_least(0),
        "INPUT.BRAIXDET.CANONICAL_SIZE": _canonical_size(),
        "INPUT.BRAIXDET.MASK_MARGIN": _number_in(0, 1),
        "INPUT.BRAIXDET.MASK_DOWNSAMPLE": _int_at_least(1),
        "INPUT.BRAIXDET.CACHE_FORMAT": _one_of("npy", "png"),
        "MODEL.BRAIXDET.CAM.METHOD": _one_of(*METHODS),
        "MODEL.BRAIXDET.CAM.TARGET_LAYER": _one_of("res3", "res4", "res5", "res3+res4+res5"),
        "MODEL.BRAIXDET.CAM.TAU": _number_in(0, 1, lo_open=True, hi_open=True),
        "SSL.EMA_ALPHA": _number_in(0, 1),
        "SSL.CAM_VIEW_AGREEMENT": _number_in(0, 1, hi_open=True),
        "SSL.LAMBDA_WEAK": _number_in(0, math.inf, hi_open=True),
        "SSL.BN_MODE": _one_of(*BN_MODES),
        "SSL.STRONG_AUG_POLICY": _one_of(*sorted(STRONG_AUG_POLICIES)),
    }


def _get(cfg, key):
    node = cfg
    for part in key.split("."):
        if part not in node:
            return _MISSING
        node = node[part]
    return node


_MISSING = object()


def validate_config(cfg):
    """Raise ConfigValueError for the first value outside its allowed set; returns ``cfg``."""
    for key, (ok, allowed) in _checks().items():
        value = _get(cfg, key)
        protocol = _get(cfg, "DATASETS.BRAIXDET.PROTOCOL")
        if key == "DATASETS.BRAIXDET.RATIO" and protocol != "partial":
            continue  # only the partially labelled protocol reads the ratio
        if value is not _MISSING and not ok(value):
            raise ConfigValueError(key, value, allowed)
    return cfg
