"""Checks that can run before training do: fail in seconds, not after hours.

``check_before_training(cfg, resume, eval_only)`` (after the datasets are registered, before the
trainer is built, on the main process):

* every dataset the run will use is registered, loads and is non-empty: DATASETS.TRAIN,
  DATASETS.TEST (the final evaluation always runs; an empty validation split used to fail only
  after model_final was written) and DATASETS.TRAIN_WEAK when SSL.ENABLED;
* the files the run will read exist, are files and can be read: MODEL.WEIGHTS (unless
  ``--resume`` finds a checkpoint; URLs such as ``detectron2://`` are left to the loader),
  MODEL.BRAIXDET.INIT_FROM_CLASSIFIER, SSL.CAM_JSON (when SSL.USE_CAM; also parsed as JSON) and
  MODEL.BRAIXDET.PRETRAINED when it is a path (it may also name a source such as ``imagenet``:
  only values with a path separator or a .pth/.pt/.safetensors/.bin suffix are files);
* OUTPUT_DIR is writable;
* no LCM.* or GCM.* key is set where the model does not build that module
  (``config.check_module_keys``; a ConfigValueError, also one line).

``check_disk_space(cfg, trainer)`` (after the trainer is built, before its first step): the
folder must have room for one checkpoint, estimated as the model's state bytes x (1 + optimizer
slots: 2 for Adam, 1 for SGD momentum) + the teacher's state bytes (stage 2 SSL), plus 10 % and
16 MB; it warns when the checkpoints the run keeps (SOLVER.BRAIXDET.CHECKPOINTS_KEPT of the
planned periodic ones, plus model_final) would not all fit.

Every failure raises ``PreflightError``: one line naming the config key, the file or dataset and
the reason (``braixdet/cli.py`` prints it as the tool's last line).
"""
import json
import logging
import os
import shutil
import tempfile

from detectron2.data import DatasetCatalog, MetadataCatalog

from ..config.checks import check_module_keys
from ..data.report import BadInputError
from ..utils.modules import unwrap

__all__ = ["PreflightError", "check_before_training", "check_disk_space",
           "checkpoint_size_estimate"]

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".pth", ".pt", ".safetensors", ".bin", ".pkl", ".pyth")


class PreflightError(RuntimeError):
    """A check before training failed; ``str`` is the one-line message."""


def _is_url(value):
    return "://" in value


def looks_like_path(value):
    """A config value meant as a file (vs. a named source such as "imagenet")."""
    value = str(value)
    return os.sep in value or "/" in value or value.lower().endswith(_WEIGHT_SUFFIXES)


def check_readable_file(key, path):
    """PreflightError unless ``path`` is a non-empty file this process can read."""
    if not os.path.exists(path):
        raise PreflightError(f"{key}: no such file {path}")
    if not os.path.isfile(path):
        raise PreflightError(f"{key}: {path} is not a file")
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError as e:
        raise PreflightError(f"{key}: cannot read {path} ({e.strerror or e})") from None
    if not first:
        raise PreflightError(f"{key}: {path} is empty")


def _check_output_dir(cfg):
    out = cfg.OUTPUT_DIR
    if not out:
        return
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".preflight-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PreflightError(f"OUTPUT_DIR: cannot write to {out} ({e.strerror or e})") from None


def _check_files(cfg, resume, eval_only):
    weights = cfg.MODEL.WEIGHTS
    resuming = resume and cfg.OUTPUT_DIR and \
        os.path.isfile(os.path.join(cfg.OUTPUT_DIR, "last_checkpoint"))
    if eval_only and not weights:
        raise PreflightError("MODEL.WEIGHTS: empty; --eval-only needs the checkpoint to "
                             "evaluate (MODEL.WEIGHTS path/to/model_final.pth)")
    if weights and not _is_url(weights) and not (resuming and not eval_only):
        check_readable_file("MODEL.WEIGHTS", weights)
    b = cfg.MODEL.BRAIXDET
    if b.get("INIT_FROM_CLASSIFIER", "") and cfg.MODEL.META_ARCHITECTURE != "MVCCLClassifier":
        check_readable_file("MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", b.INIT_FROM_CLASSIFIER)
    pretrained = str(b.get("PRETRAINED", "") or "")
    if pretrained and looks_like_path(pretrained) and not _is_url(pretrained):
        check_readable_file("MODEL.BRAIXDET.PRETRAINED", pretrained)
    s = cfg.get("SSL", None)
    if s is not None and s.ENABLED and s.USE_CAM and s.CAM_JSON and not eval_only:
        check_readable_file("SSL.CAM_JSON", s.CAM_JSON)
        try:
            with open(s.CAM_JSON, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
        except (ValueError, RecursionError) as e:
            raise PreflightError(f"SSL.CAM_JSON: {s.CAM_JSON} is not valid JSON "
                                 f"({str(e).splitlines()[0][:80]})") from None
        if not isinstance(data, dict):
            raise PreflightError(f"SSL.CAM_JSON: {s.CAM_JSON} is not the JSON object written "
                                 "by tools/gradcam_pseudo_labels.py")


def _dataset_roles(cfg, eval_only):
    roles = [] if eval_only else [("DATASETS.TRAIN", tuple(cfg.DATASETS.TRAIN))]
    if not eval_only and cfg.get("SSL", None) is not None and cfg.SSL.ENABLED:
        roles.append(("DATASETS.TRAIN_WEAK", tuple(cfg.DATASETS.get("TRAIN_WEAK", ()))))
    roles.append(("DATASETS.TEST", tuple(cfg.DATASETS.TEST)))
    return roles


def _check_datasets(cfg, eval_only):
    for key, names in _dataset_roles(cfg, eval_only):
        if not names and key != "DATASETS.TEST":
            raise PreflightError(f"{key}: no dataset configured (set DATASETS.BRAIXDET.ROOT, or "
                                 f"{key} to registered dataset names)")
        for name in names:
            if name not in DatasetCatalog.list():
                raise PreflightError(f"{key}: dataset {name!r} is not registered (check "
                                     "DATASETS.BRAIXDET.ROOT / NAME or the dataset name)")
            try:
                n = len(DatasetCatalog.get(name))
            except BadInputError:
                raise  # ON_BAD_INPUT error: already one line naming the file
            except Exception as e:  # noqa: BLE001 - any loader failure is one line here
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise PreflightError(f"{key}: dataset {name!r} could not be loaded: {msg}") \
                    from None
            if n == 0:
                meta = MetadataCatalog.get(name)
                hint = ""
                if meta.get("role", None) == "val":
                    hint = ("; it is the validation split: raise DATASETS.BRAIXDET.VAL_FRACTION "
                            "or set DATASETS.TEST to other datasets")
                elif meta.get("report_path", None):
                    hint = f"; see the bad-input report {meta.report_path}"
                raise PreflightError(f"{key}: dataset {name!r} is empty{hint}")
            if MetadataCatalog.get(name).get("role", None) == "val":
                _check_val_has_lesions(cfg, key, name, DatasetCatalog.get(name))


def _check_val_has_lesions(cfg, key, name, dicts):
    """A lesion-free validation split gives AP/AUC NaN: no best model, no plateau signal."""
    if cfg.DATASETS.BRAIXDET.get("ALLOW_LESION_FREE_VAL", False):
        return
    if cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier":
        has = any(d.get("label") == 1 for d in dicts)
    else:
        has = any(d.get("annotations") for d in dicts)
    if not has:
        raise PreflightError(
            f"{key}: validation dataset {name!r} ({len(dicts)} images) has no lesion, so its "
            "AP/AUC is undefined; raise DATASETS.BRAIXDET.VAL_FRACTION, use another "
            "DATASETS.BRAIXDET.SEED, or set DATASETS.BRAIXDET.ALLOW_LESION_FREE_VAL True")


def check_before_training(cfg, resume=False, eval_only=False):
    """Run every check (cheap ones first); raise PreflightError (ConfigValueError for a key
    that would do nothing in training) on the first failure."""
    if not eval_only:
        check_module_keys(cfg)
    _check_output_dir(cfg)
    _check_files(cfg, resume, eval_only)
    _check_datasets(cfg, eval_only)
    logger.info("Pre-flight checks passed (datasets, init files, OUTPUT_DIR)")


def _state_bytes(module):
    return sum(t.numel() * t.element_size() for t in module.state_dict().values()
               if hasattr(t, "element_size"))


def checkpoint_size_estimate(model, teacher=None, optimizer="ADAM"):
    """Bytes of one checkpoint: model state x (1 + optimizer slots) + teacher state."""
    slots = 2 if str(optimizer).upper() == "ADAM" else 1
    return _state_bytes(model) * (1 + slots) + (_state_bytes(teacher) if teacher else 0)


def _free_bytes(path):
    return shutil.disk_usage(path).free


def check_disk_space(cfg, trainer):
    """PreflightError when OUTPUT_DIR has no room for one checkpoint (see module doc)."""
    model = unwrap(trainer.model)
    opt = cfg.SOLVER.get("BRAIXDET", {}).get("OPTIMIZER", "ADAM")
    size = checkpoint_size_estimate(model, getattr(trainer, "teacher", None), opt)
    need = int(size * 1.1) + (16 << 20)
    free = _free_bytes(cfg.OUTPUT_DIR)
    mb = 1 << 20
    if free < need:
        raise PreflightError(f"OUTPUT_DIR: {free / mb:.0f} MB free on {cfg.OUTPUT_DIR}, a "
                             f"checkpoint needs about {need / mb:.0f} MB; free some space or use "
                             "another OUTPUT_DIR")
    period, max_iter = cfg.SOLVER.CHECKPOINT_PERIOD, cfg.SOLVER.MAX_ITER
    periodic = (max(0, max_iter - 1 - getattr(trainer, "start_iter", 0)) // period
                if period > 0 else 0)
    kept = cfg.SOLVER.get("BRAIXDET", {}).get("CHECKPOINTS_KEPT", 0)
    planned = 1 + (min(periodic, kept) if kept else periodic)  # + model_final
    if free < planned * size:
        logger.warning("OUTPUT_DIR %s: %.0f MB free, the %d checkpoints the run keeps need about "
                       "%.0f MB, so the disk may fill up (SOLVER.BRAIXDET.CHECKPOINTS_KEPT)",
                       cfg.OUTPUT_DIR, free / mb, planned, planned * size / mb)
