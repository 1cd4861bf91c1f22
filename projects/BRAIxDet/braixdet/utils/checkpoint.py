"""Crash-safe, code-execution-free checkpoint files: the one place that writes and reads them.

Training checkpoints go through engine/checkpoint.py's ``AtomicCheckpointer`` (detectron2's
checkpointer on these helpers); the model, inference and the tools read weights here.

* Writes go to a temporary file in the same directory, are fsync'ed and then ``os.replace``'d, so
  a job killed mid-write leaves the previous checkpoint and a ``last_checkpoint`` that names a
  complete file (stale ``.*.tmp`` files are ignored by ``get_all_checkpoint_files``).
* Only tensors and plain Python values are saved (checked before writing), and ``.pth`` files are
  read with ``torch.load(weights_only=True)``: a crafted pickle cannot run code. detectron2's
  ``.pkl`` model-zoo files are read with a restricted unpickler (numpy arrays and plain values).
* Failures are one line a user can act on: a refused file raises ``CheckpointRefusedError``
  (``refusing to load X: it contains Python objects ...``), an unreadable one
  ``CheckpointLoadError``, and a write that fails (e.g. a full disk) ``CheckpointWriteError``
  (``no space left on device while writing checkpoint X (free: 12 MB); the previous checkpoint
  is intact``) after removing its temporary file.
"""
import collections
import logging
import os
import pickle

import torch

from .io import OutputWriteError, atomic_write
from .modules import unwrap

__all__ = [
    "CheckpointContentError",
    "CheckpointLoadError",
    "CheckpointRefusedError",
    "CheckpointWriteError",
    "atomic_torch_save",
    "check_checkpoint_content",
    "export_model_only",
    "load_inference_weights",
    "safe_torch_load",
    "save_checkpoint_file",
]

logger = logging.getLogger(__name__)

# Everything below round-trips through torch.load(weights_only=True).
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype,
               torch.device)
_DICT_TYPES = (dict, collections.OrderedDict)
_SEQ_TYPES = (list, tuple, set)


class CheckpointWriteError(OutputWriteError):
    """A checkpoint write failed (e.g. ENOSPC); the file it would have replaced is untouched."""

    what = "checkpoint"

    @staticmethod
    def unchanged(dirname):
        return ("the previous checkpoint is intact"
                if os.path.exists(os.path.join(dirname, "last_checkpoint"))
                else "no earlier file was changed")


class CheckpointContentError(TypeError):
    """A checkpoint value that is not a tensor or a plain Python value."""


class CheckpointRefusedError(pickle.UnpicklingError):
    """torch.load(weights_only=True) (or the .pkl unpickler) refused the file: it holds pickled
    Python objects that could run code. ``str`` is one line naming the file."""

    def __init__(self, path, detail="", reason=""):
        self.path, self.detail = str(path), detail
        reason = reason or ("it contains Python objects other than tensors and plain values "
                            "(weights_only)")
        super().__init__(f"refusing to load {self.path}: {reason}")


class CheckpointLoadError(RuntimeError):
    """A checkpoint file that cannot be read (truncated, not a PyTorch file). One line."""

    def __init__(self, path, detail=""):
        self.path, self.detail = str(path), detail
        super().__init__(f"cannot load checkpoint {self.path}: not a complete PyTorch checkpoint "
                         f"(truncated or another format?){': ' + detail if detail else ''}")


def check_checkpoint_content(obj, path="checkpoint"):
    """Raise CheckpointContentError naming the first key whose value would need arbitrary
    unpickling (numpy arrays, custom classes, functions, defaultdict, namedtuples...)."""
    if isinstance(obj, torch.Tensor) or type(obj) in _LEAF_TYPES:
        return
    if type(obj) in _DICT_TYPES:
        for k, v in obj.items():
            if type(k) not in _LEAF_TYPES:
                raise CheckpointContentError(
                    f"Checkpoint key {k!r} under '{path}' has type {type(k).__qualname__}")
            check_checkpoint_content(v, f"{path}.{k}")
        return
    if type(obj) in _SEQ_TYPES:
        for i, v in enumerate(obj):
            check_checkpoint_content(v, f"{path}[{i}]")
        return
    raise CheckpointContentError(
        f"Checkpoint value at '{path}' has type {type(obj).__module__}.{type(obj).__qualname__}; "
        "only tensors and plain Python values (dict/list/tuple/set of int, float, str, bool, "
        "None, ...) are allowed so that the file loads with torch.load(weights_only=True). "
        "Convert it (e.g. numpy -> torch.as_tensor or .tolist()).")


def atomic_torch_save(data, path):
    """Validate ``data`` (tensors and plain values only), then torch.save it atomically."""
    check_checkpoint_content(data)
    save_checkpoint_file(path, lambda f: torch.save(data, f))


def save_checkpoint_file(path, write_fn, mode="wb"):
    """Write a checkpoint file atomically with ``write_fn(f)``; a failed write raises
    CheckpointWriteError (one line) and leaves the previous file."""
    # one writer per checkpoint file (the main process): stale temp files can go
    atomic_write(path, write_fn, mode, remove_stale=True, error_cls=CheckpointWriteError)


def safe_torch_load(f):
    """torch.load that never executes pickled code (weights_only=True), onto the CPU.

    ``f``: a path or an open binary file. A file holding other Python objects raises
    CheckpointRefusedError (a pickle.UnpicklingError), a truncated / non-PyTorch file
    CheckpointLoadError; both say which file on one line.
    """
    name = getattr(f, "name", f)
    try:
        return torch.load(f, map_location=torch.device("cpu"), weights_only=True)
    except pickle.UnpicklingError as e:  # also _pickle.UnpicklingError (the same class)
        raise CheckpointRefusedError(name, str(e).splitlines()[0] if str(e) else "") from e
    except RuntimeError as e:
        msg = str(e)
        if "Weights only load failed" in msg:
            raise CheckpointRefusedError(name, msg.splitlines()[0]) from e
        if "PytorchStreamReader" in msg or "zip archive" in msg or "inline_container" in msg:
            raise CheckpointLoadError(name, msg.splitlines()[0][:120]) from e
        raise
    except (EOFError, ValueError) as e:  # empty file / legacy format garbage
        raise CheckpointLoadError(name, f"{type(e).__name__}: {e}".splitlines()[0][:120]) \
            from e


def export_model_only(model, path):
    """Atomically write ``{"model": state_dict}`` (unwrapped from DDP), e.g. the teacher alone.
    It loads into a plain model with ``AtomicCheckpointer(model).load(path)`` or
    ``DetectionCheckpointer(model).load(path)``."""
    atomic_torch_save({"model": unwrap(model).state_dict()}, path)
    return path




def load_inference_weights(model, path, prefer_teacher=True):
    """Load a checkpoint for inference: the teacher when the file holds one (stage 2 SSL)."""
    ckpt = safe_torch_load(path)  # one-line CheckpointRefusedError for a crafted pickle
    state = ckpt.get("teacher") if prefer_teacher and "teacher" in ckpt else ckpt.get("model", ckpt)
    incompatible = model.load_state_dict(state, strict=False)
    if incompatible.missing_keys:
        logger.warning("%s: %d missing keys, e.g. %s", path, len(incompatible.missing_keys),
                       incompatible.missing_keys[:3])
    return model
