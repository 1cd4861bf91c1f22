"""detectron2's checkpointer with atomic saves and weights-only loading, for training.

The file format and its safety (what may be saved, what is refused on load, one-line errors) are
utils/checkpoint.py's.
"""
import os
import pickle

import torch
from detectron2.checkpoint import DetectionCheckpointer

from ..utils.checkpoint import (
    CheckpointRefusedError,
    check_checkpoint_content,
    safe_torch_load,
    save_checkpoint_file,
)

__all__ = ["AtomicCheckpointer"]


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
        err = pickle.UnpicklingError(
            f"Refusing to unpickle global '{module}.{name}' from a .pkl checkpoint")
        err.global_name = f"{module}.{name}"
        raise err


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
        save_checkpoint_file(save_file, lambda f: torch.save(data, f))
        self.tag_last_checkpoint(basename)

    def tag_last_checkpoint(self, last_filename_basename: str) -> None:
        save_file = os.path.join(self.save_dir, "last_checkpoint")
        save_checkpoint_file(save_file, lambda f: f.write(last_filename_basename), mode="w")

    def _load_file(self, filename):
        if filename.endswith(".pkl"):
            with open(filename, "rb") as f:
                try:
                    data = _RestrictedUnpickler(f, encoding="latin1").load()
                except pickle.UnpicklingError as e:
                    what = getattr(e, "global_name", None)
                    raise CheckpointRefusedError(filename, str(e), reason=(
                        f"it contains the Python global '{what}', not only numpy arrays and "
                        "plain values (.pkl)") if what else "") from e
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
