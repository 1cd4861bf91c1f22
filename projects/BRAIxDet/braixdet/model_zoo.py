"""The configs that ship with the package, found the same way installed or in a checkout.

Like detectron2's ``model_zoo.get_config_file``: ``get_config_file("BRAIxDet/braixdet.yaml")``
returns the path of a packaged config. A wheel or a non-editable install carries the
repository's ``configs/`` as ``braixdet/configs/`` (setup.py maps it there); a source checkout
(PYTHONPATH or an editable install) reads ``configs/`` itself, so there is one copy to edit.
"""
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOTS = (os.path.join(_HERE, "configs"),  # installed: braixdet/configs
          os.path.normpath(os.path.join(_HERE, "..", "..", "..", "configs")))  # checkout
_MARKER = "Base-BRAIxDet.yaml"  # a folder holding it is a config root, not a stray "configs"
_STAGE1 = os.path.join("MVCCL", "mvccl.yaml")  # what every --configs root (paper, demo) holds


def config_root():
    """The folder of the packaged configs (``configs/`` of the repository)."""
    for root in _ROOTS:
        if os.path.isfile(os.path.join(root, _MARKER)):
            return root
    raise FileNotFoundError(
        f"the BRAIxDet configs are missing: neither {_ROOTS[0]} (installed package) nor "
        f"{_ROOTS[1]} (source checkout) holds {_MARKER}; reinstall the package")


def get_config_file(rel):
    """Path of the packaged config ``rel`` (e.g. "BRAIxDet/braixdet.yaml",
    "demo/MVCCL/mvccl.yaml")."""
    path = os.path.join(config_root(), rel)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{rel} is not one of the packaged configs ({config_root()})")
    return path


def resolve_config_root(value):
    """A ``--configs`` value: an existing folder as given (e.g. "configs/demo" in a checkout),
    else a folder of the packaged configs ("" for the paper's, "demo"), so the same command
    runs from any directory once the package is installed."""
    if value and os.path.isfile(os.path.join(value, _STAGE1)):
        return os.path.abspath(value)
    rel = value.replace(os.sep, "/")
    rel = rel[len("configs/"):] if rel.startswith("configs/") else "" if rel == "configs" else rel
    path = os.path.join(config_root(), rel)
    if not os.path.isfile(os.path.join(path, _STAGE1)):
        raise FileNotFoundError(f"--configs {value}: neither a config folder here nor a "
                                f"packaged config root ({config_root()}, or 'demo' in it)")
    return os.path.normpath(path)
