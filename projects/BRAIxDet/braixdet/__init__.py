"""BRAIxDet for Detectron2: malignant lesion detection from incompletely annotated mammograms."""
from . import modeling  # noqa: F401  (registers backbones and meta-architectures)
from .config import add_braixdet_config

__all__ = ["add_braixdet_config"]
