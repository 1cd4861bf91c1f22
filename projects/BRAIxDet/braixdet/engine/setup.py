"""Config set-up shared by tools: merge files, register datasets, derive dataset names."""
import logging
import os

from detectron2.config import get_cfg

from ..config import add_braixdet_config, check_supported_keys
from ..utils.io import refuse_links
from .checkpoint import safe_torch_load
from .runtime import apply_num_threads
from .validate import ConfigValueError, validate_config

logger = logging.getLogger(__name__)


def build_cfg(config_file="", opts=()):
    cfg = get_cfg()
    add_braixdet_config(cfg)
    if config_file:
        cfg.merge_from_file(config_file)
    cfg.merge_from_list(list(opts))
    try:
        check_supported_keys(cfg)
    except ValueError as e:  # one line, like every other refused value
        raise ConfigValueError(str(e).split(" ")[0], None, "", message=str(e)) from None
    cfg = validate_config(cfg)
    apply_num_threads(cfg)  # before any computation of this process (engine/runtime.py)
    return cfg


def check_output_dir_links(output_dir):
    """Refuse a symbolic link among OUTPUT_DIR's entries (OutputPathRefused, one line) before
    detectron2 opens config.yaml, log.txt and metrics.json there without O_NOFOLLOW: a planted
    link would make it overwrite or append to a file outside the folder. Call after the lock."""
    if output_dir:
        refuse_links(output_dir)


def register_and_assign_datasets(cfg):
    """Register the configured dataset and fill empty DATASETS.* from the protocol's names.

    The protocol (PROTOCOL, RATIO, SEED) is a config key, so one config file serves every
    ratio/seed: e.g. ``DATASETS.BRAIXDET.RATIO 1/4 DATASETS.BRAIXDET.SEED 2``.
    """
    from ..data.register import register_from_cfg

    if not cfg.DATASETS.BRAIXDET.ROOT:
        return {}
    if not cfg.DATASETS.BRAIXDET.SPLIT_DIR:
        cfg.DATASETS.BRAIXDET.SPLIT_DIR = os.path.join(cfg.OUTPUT_DIR, "splits")
    names = register_from_cfg(cfg)
    if cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier":
        train, test = (names["train_all"],), (names["val"], names["test_cls"])
        weak = ()
    else:
        # validation first: it drives ReduceLROnPlateau and the best checkpoint
        train, test, weak = (names["train_full"],), (names["val"], names["test"]), \
            (names["train_weak"],)
    if not cfg.DATASETS.TRAIN:
        cfg.DATASETS.TRAIN = train
    if not cfg.DATASETS.TEST:
        cfg.DATASETS.TEST = test
    if not cfg.DATASETS.TRAIN_WEAK:
        cfg.DATASETS.TRAIN_WEAK = weak
    return names


def load_inference_weights(model, path, prefer_teacher=True):
    """Load a checkpoint for inference: the teacher when the file holds one (stage 2 SSL)."""
    ckpt = safe_torch_load(path)  # one-line CheckpointRefusedError for a crafted pickle
    state = ckpt.get("teacher") if prefer_teacher and "teacher" in ckpt else ckpt.get("model", ckpt)
    incompatible = model.load_state_dict(state, strict=False)
    if incompatible.missing_keys:
        logger.warning("%s: %d missing keys, e.g. %s", path, len(incompatible.missing_keys),
                       incompatible.missing_keys[:3])
    return model
