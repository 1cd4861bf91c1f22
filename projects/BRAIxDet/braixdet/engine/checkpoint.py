"""Crash-safe, code-execution-free checkpoints.

* Writes go to a temporary file in the same directory, are fsync'ed and then ``os.replace``'d, so
  a job killed mid-write leaves the previous checkpoint and a ``last_checkpoint`` that names a
  complete file (stale ``.*.tmp`` files are ignored by ``get_all_checkpoint_files``).
* Only tensors and plain Python values are saved (checked before writing), and ``.pth`` files are
  read with ``torch.load(weights_only=True)``: a crafted pickle cannot run code. detectron2's
  ``.pkl`` model-zoo files are read with a restricted unpickler (numpy arrays and plain values).
"""
import collections
import logging
import os
import pickle
import tempfile

import torch
from detectron2.checkpoint import DetectionCheckpointer
from torch import nn

__all__ = [
    "AtomicCheckpointer",
    "CheckpointContentError",
    "atomic_torch_save",
    "check_checkpoint_content",
    "export_model_only",
    "safe_torch_load",
]

logger = logging.getLogger(__name__)

# Everything below round-trips through torch.load(weights_only=True).
_LEAF_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.Size, torch.dtype,
               torch.device)
_DICT_TYPES = (dict, collections.OrderedDict)
_SEQ_TYPES = (list, tuple, set)


class CheckpointContentError(TypeError):
    """A checkpoint value that is not a tensor or a plain Python value."""


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


def _fsync_dir(dirname):
    try:
        fd = os.open(dirname, os.O_RDONLY)
    except OSError:  # e.g. platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_stale_tmp(dirname, basename):
    # temp files of earlier writes of the same file that were killed before os.replace
    prefix = f".{basename}."
    for f in os.listdir(dirname):
        if f.startswith(prefix) and f.endswith(".tmp"):
            try:
                os.unlink(os.path.join(dirname, f))
            except OSError:
                pass


def _atomic_write(path, write_fn, mode="wb"):
    """write_fn(f) into a temp file next to ``path``, fsync, then atomically replace ``path``.
    Single writer per path assumed (the main process), so stale temp files can be removed."""
    dirname = os.path.dirname(os.path.abspath(path))
    os.makedirs(dirname, exist_ok=True)
    _remove_stale_tmp(dirname, os.path.basename(path))
    fd, tmp = tempfile.mkstemp(dir=dirname, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(dirname)  # make the rename itself durable


def atomic_torch_save(data, path):
    """Validate ``data`` (tensors and plain values only), then torch.save it atomically."""
    check_checkpoint_content(data)
    _atomic_write(path, lambda f: torch.save(data, f))


def safe_torch_load(path):
    """torch.load that never executes pickled code (weights_only=True), onto the CPU."""
    return torch.load(path, map_location=torch.device("cpu"), weights_only=True)


def export_model_only(model, path):
    """Atomically write ``{"model": state_dict}`` (unwrapped from DDP), e.g. the teacher alone.
    It loads into a plain model with ``AtomicCheckpointer(model).load(path)`` or
    ``DetectionCheckpointer(model).load(path)``."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    atomic_torch_save({"model": model.state_dict()}, path)
    return path


class _RestrictedUnpickler(pickle.Unpickler):
    """For detectron2/Caffe2 model-zoo ``.pkl`` files: numpy arrays and builtin containers only."""

    _ALLOWED = {
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),  # numpy arrays pickled with protocol 2 under Python 3
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),  # protocol 5 (numpy >= 1.16)
        ("numpy._core.numeric", "_frombuffer"),
    }

    def find_class(self, module, name):
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"Refusing to unpickle global '{module}.{name}' from a .pkl checkpoint")


class AtomicCheckpointer(DetectionCheckpointer):
    """DetectionCheckpointer with atomic saves and weights-only loading (see module docstring).

    Same constructor and API as detectron2's (``save``, ``load``, ``resume_or_load``,
    ``has_checkpoint``, ``get_checkpoint_file``, ``tag_last_checkpoint``); e.g.
    ``AtomicCheckpointer(student, out_dir, trainer=weakref.proxy(trainer), teacher=teacher)``.
    """

    def save(self, name: str, **kwargs) -> None:
        if not self.save_dir or not self.save_to_disk:
            return
        data = {"model": self.model.state_dict()}
        for key, obj in self.checkpointables.items():
            data[key] = obj.state_dict()
        data.update(kwargs)

        basename = f"{name}.pth"
        save_file = os.path.join(self.save_dir, basename)
        assert os.path.basename(save_file) == basename, basename
        check_checkpoint_content(data)  # before touching the disk
        self.logger.info(f"Saving checkpoint to {save_file}")
        _atomic_write(save_file, lambda f: torch.save(data, f))
        self.tag_last_checkpoint(basename)

    def tag_last_checkpoint(self, last_filename_basename: str) -> None:
        save_file = os.path.join(self.save_dir, "last_checkpoint")
        _atomic_write(save_file, lambda f: f.write(last_filename_basename), mode="w")

    def _load_file(self, filename):
        if filename.endswith(".pkl"):
            with open(filename, "rb") as f:
                data = _RestrictedUnpickler(f, encoding="latin1").load()
            # Same conversions as DetectionCheckpointer for model-zoo files.
            if "model" in data and "__author__" in data:
                self.logger.info(f"Reading a file from '{data['__author__']}'")
                return data
            if "blobs" in data:
                data = data["blobs"]
            data = {k: v for k, v in data.items() if not k.endswith("_momentum")}
            return {"model": data, "__author__": "Caffe2", "matching_heuristics": True}
        if filename.endswith(".pyth"):  # pycls
            data = safe_torch_load(filename)
            assert "model_state" in data, f"Cannot load .pyth file {filename}: no 'model_state'."
            model_state = {
                k: v for k, v in data["model_state"].items()
                if not k.endswith("num_batches_tracked")
            }
            return {"model": model_state, "__author__": "pycls", "matching_heuristics": True}
        loaded = safe_torch_load(filename)
        if "model" not in loaded:
            loaded = {"model": loaded}
        return loaded
