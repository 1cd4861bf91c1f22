"""Schedules in epochs (paper: 20 epochs per stage) and the validation metric each stage follows.

An epoch is one pass over the stage's epoch set, per protocol:

* stage 1 (classifier), every protocol: D_s ∪ D_w (DATASETS.TRAIN) at SOLVER.IMS_PER_BATCH
  (D_w is empty under "supervised_only");
* stage 2 (every detector row), protocol "partial": D_w (DATASETS.TRAIN_WEAK) at
  DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH;
* stage 2, protocol "full": D_w likewise when it holds images (the source's weakly annotated
  cases), else D_s (DATASETS.TRAIN) at SOLVER.IMS_PER_BATCH; "supervised_only": D_s.

Sizing stage 2 by D_w makes the GradCAM fusion window ("the first 2 of 20 epochs") 2/20 of the
training and lets the supervised baselines, which read no D_w, train the same number of
iterations as the SSL rows. With an empty D_w (the fully supervised protocol on a source without
weak cases) there is nothing to pseudo-label: an epoch is a pass over D_s (our choice), and a
student-teacher config trains its supervised part only (``has_weak_images``; see
``engine/trainers.trainer_class``).
``SOLVER.MAX_ITER`` <= 0 means SOLVER.BRAIXDET.EPOCHS epochs; ``TEST.EVAL_PERIOD`` < 0 and
``SOLVER.CHECKPOINT_PERIOD`` <= 0 mean once per epoch (the paper's ReduceLROnPlateau runs per
epoch). Positive values are iterations and win.
"""
import logging
import math
from dataclasses import dataclass

from detectron2.data import DatasetCatalog
from detectron2.engine import DefaultTrainer
from detectron2.utils import comm

from .defaults import PAPER_CAM_FUSION_EPOCHS, PAPER_EPOCHS

__all__ = ["num_images", "has_weak_images", "iterations_per_epoch", "resolve_schedule",
           "validation_metric", "ValidationMetric", "metric_mode", "cam_fusion_epochs",
           "stage2_epochs_opts"]

logger = logging.getLogger(__name__)


def num_images(dataset_names):
    return sum(len(DatasetCatalog.get(n)) for n in dataset_names)


def has_weak_images(cfg):
    """Whether a detector config has a non-empty D_w (DATASETS.TRAIN_WEAK)."""
    return bool(cfg.DATASETS.TRAIN_WEAK) and num_images(cfg.DATASETS.TRAIN_WEAK) > 0


def iterations_per_epoch(cfg):
    """(iterations per epoch, what an epoch is) for the stage this config trains (see the
    module docstring: D_w for a detector, D_s when D_w is empty, D_s ∪ D_w for stage 1)."""
    if cfg.MODEL.META_ARCHITECTURE != "MVCCLClassifier" and has_weak_images(cfg):
        names, batch, what = (cfg.DATASETS.TRAIN_WEAK,
                              cfg.DATALOADER.BRAIXDET.WEAK_IMS_PER_BATCH, "D_w")
    else:
        names, batch, what = cfg.DATASETS.TRAIN, cfg.SOLVER.IMS_PER_BATCH, "the training set"
    n = num_images(names)
    if n == 0:
        raise ValueError(f"cannot size an epoch: {list(names)} hold no image")
    return max(1, math.ceil(n / batch)), f"{what}: {n} images / batch {batch}"


def cam_fusion_epochs(epochs):
    """Algorithm 2's GradCAM fusion window for a stage 2 of ``epochs`` epochs of D_w: the
    paper's share of the schedule (its first 2 of 20 epochs)."""
    return epochs * PAPER_CAM_FUSION_EPOCHS / PAPER_EPOCHS


def stage2_epochs_opts(epochs):
    """Config overrides that give the detectors ``epochs`` epochs of D_w with the fusion
    window moved along (``cam_fusion_epochs``). SSL.CAM_FUSION_EPOCHS alone is absolute: a
    script that changes a config's schedule without it keeps the config's window, e.g. the demo's
    0.3 epochs (2 of 20 scaled to its 3), half the paper's share at 6 epochs (RESULTS §22)."""
    # floats as str() writes them: yacs refuses an int literal for a float key
    return ["SOLVER.BRAIXDET.EPOCHS", str(float(epochs)),
            "SSL.CAM_FUSION_EPOCHS", str(float(cam_fusion_epochs(epochs)))]


def resolve_schedule(cfg):
    """A copy of ``cfg`` with the batch scaled to the world size (detectron2's
    SOLVER.REFERENCE_WORLD_SIZE) and MAX_ITER / EVAL_PERIOD / CHECKPOINT_PERIOD set from epochs
    where they ask for it (see the module docstring); ``cfg`` itself when nothing changes (a
    resolved config, e.g. a run's config.yaml)."""
    cfg = DefaultTrainer.auto_scale_workers(cfg, comm.get_world_size())
    s = cfg.SOLVER
    if s.MAX_ITER > 0 and cfg.TEST.EVAL_PERIOD >= 0 and s.CHECKPOINT_PERIOD > 0:
        if s.BRAIXDET.EPOCHS > 0:
            logger.info("Schedule: SOLVER.MAX_ITER %d (set explicitly; SOLVER.BRAIXDET.EPOCHS "
                        "not used)", s.MAX_ITER)
        return cfg
    ipe, what = iterations_per_epoch(cfg)
    frozen = cfg.is_frozen()
    cfg = cfg.clone()
    cfg.defrost()
    if s.MAX_ITER <= 0:  # EPOCHS > 0: checks.py
        cfg.SOLVER.MAX_ITER = max(1, round(s.BRAIXDET.EPOCHS * ipe))
    if cfg.TEST.EVAL_PERIOD < 0:
        cfg.TEST.EVAL_PERIOD = ipe
    if cfg.SOLVER.CHECKPOINT_PERIOD <= 0:
        cfg.SOLVER.CHECKPOINT_PERIOD = ipe
    logger.info("Schedule: %d iterations per epoch (%s); MAX_ITER %d (%g epochs), evaluation "
                "every %d, checkpoint every %d iterations", ipe, what, cfg.SOLVER.MAX_ITER,
                cfg.SOLVER.MAX_ITER / ipe, cfg.TEST.EVAL_PERIOD, cfg.SOLVER.CHECKPOINT_PERIOD)
    if frozen:
        cfg.freeze()
    return cfg


@dataclass(frozen=True)
class ValidationMetric:
    key: str  # as flattened into the event storage, e.g. "cbis_ddsm_val_s0/bbox/AP20"
    mode: str  # "min" | "max"


_LOWER_IS_BETTER = ("bce", "loss")


def metric_mode(metric):
    """"min" for a metric to minimise (its last name part contains "bce" or "loss"), else
    "max": how ReduceLROnPlateau and the best export compare its values."""
    low = metric.rsplit("/", 1)[-1].lower()
    return "min" if any(s in low for s in _LOWER_IS_BETTER) else "max"


def validation_metric(cfg):
    """The metric ReduceLROnPlateau and the best export follow: SOLVER.BRAIXDET.PLATEAU_METRIC
    (default: stage 1 classification/BCE, stage 2 bbox/AP20 of the teacher; stage 2 follows the
    paper's validation BCE with "screening/image_BCE") on the FIRST dataset of DATASETS.TEST
    (the validation set); None without periodic evaluation. Names containing "bce" or "loss"
    are minimised, every other metric is maximised."""
    if not cfg.DATASETS.TEST or cfg.TEST.EVAL_PERIOD == 0:
        return None
    metric = cfg.SOLVER.BRAIXDET.PLATEAU_METRIC or (
        "classification/BCE" if cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier"
        else f"bbox/AP{int(round(cfg.TEST.BRAIXDET.IOU_THRESH * 100))}")
    key = metric if len(cfg.DATASETS.TEST) == 1 else f"{cfg.DATASETS.TEST[0]}/{metric}"
    return ValidationMetric(key, metric_mode(metric))
