"""Build a run's config once: merge, check, decide defaults, then resolve what the data decides.

* ``build_cfg(config_file, opts)``: every BRAIxDet key added, the file and overrides merged, every
  value checked (checks.py), the ratio recorded as parsed ("p/q") and the split folder decided
  (``<OUTPUT_DIR>/splits`` when SPLIT_DIR is empty). Nothing is read or written.
* ``resolve_cfg(cfg)``: the datasets registered (lazily) and the empty DATASETS.* filled with the
  protocol's names, the batch scaled to the world size (detectron2's REFERENCE_WORLD_SIZE) and
  the schedule in iterations (schedule.py). A training run calls it before detectron2's
  ``default_setup``, so the ``config.yaml`` it writes is what runs: training again from that file
  alone gives the same weights.
* ``inference_cfg(cfg, weights)``: the config every inference path builds its model from.
"""
import os

from detectron2.config import get_cfg

from ..data.protocols import parse_ratio
from ..data.register import register_from_cfg
from ..utils.runtime import apply_num_threads
from .checks import check_config
from .defaults import add_braixdet_config
from .schedule import resolve_schedule

__all__ = ["build_cfg", "resolve_cfg", "register_datasets", "inference_cfg", "ratio_string"]


def ratio_string(ratio):
    """A ratio as the config records it, "p/q" (0.125 -> "1/8", 1 -> "1/1"): a bare "1" would be
    read back from a command line or YAML as an int, which the key refuses."""
    r = parse_ratio(ratio)
    return f"{r.numerator}/{r.denominator}"


def build_cfg(config_file="", opts=()):
    """A checked config with its defaults decided (module docstring); not frozen."""
    cfg = get_cfg()
    add_braixdet_config(cfg)
    if config_file:
        cfg.merge_from_file(config_file)
    cfg.merge_from_list(list(opts))
    check_config(cfg)
    b = cfg.DATASETS.BRAIXDET
    if b.PROTOCOL == "partial":
        b.RATIO = ratio_string(b.RATIO)
    if not b.SPLIT_DIR:
        b.SPLIT_DIR = os.path.join(cfg.OUTPUT_DIR, "splits")
    apply_num_threads(cfg)  # before any computation of this process (utils/runtime.py)
    return cfg


def register_datasets(cfg):
    """Register the configured dataset's protocol splits (lazily: nothing is loaded);
    {role: registered name}, {} without DATASETS.BRAIXDET.ROOT. Registering again is a no-op."""
    return register_from_cfg(cfg) if cfg.DATASETS.BRAIXDET.ROOT else {}


def _assign_datasets(cfg, names):
    """The empty DATASETS.* of ``cfg`` from the protocol's names (in place)."""
    if cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier":
        train, test, weak = (names["train_all"],), (names["val"], names["test_cls"]), ()
    else:
        # validation first: it drives ReduceLROnPlateau and the best checkpoint
        train, test, weak = (names["train_full"],), (names["val"], names["test"]), \
            (names["train_weak"],)
    for key, value in (("TRAIN", train), ("TEST", test), ("TRAIN_WEAK", weak)):
        if not cfg.DATASETS[key]:
            cfg.DATASETS[key] = value


def resolve_cfg(cfg):
    """``cfg`` with what the datasets and the world size decide written in (module docstring):
    ``cfg`` itself when that is already there (e.g. a run's own config.yaml), else a copy,
    frozen if ``cfg`` was. The protocol (PROTOCOL, RATIO, SEED) is a config key, so one config
    file serves every ratio/seed: e.g. ``DATASETS.BRAIXDET.RATIO 1/4 DATASETS.BRAIXDET.SEED 2``.
    """
    names = register_datasets(cfg)
    d = cfg.DATASETS
    fill = names and not (d.TRAIN and d.TEST and
                          (d.TRAIN_WEAK or cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier"))
    if fill:
        frozen = cfg.is_frozen()
        cfg = cfg.clone()
        cfg.defrost()
        _assign_datasets(cfg, names)
        if frozen:
            cfg.freeze()
    return resolve_schedule(cfg) if cfg.DATASETS.TRAIN else cfg


def inference_cfg(cfg, weights):
    """A frozen copy of ``cfg`` for a model that ``weights`` (a checkpoint of this project)
    initialises entirely: MODEL.WEIGHTS set, no stage-1 initialisation, so the encoder is not
    built from ImageNet or a classifier first (modeling/backbone.encoder_init)."""
    cfg = cfg.clone()
    cfg.defrost()
    cfg.MODEL.WEIGHTS = str(weights)
    cfg.MODEL.BRAIXDET.INIT_FROM_CLASSIFIER = ""
    cfg.freeze()
    return cfg
