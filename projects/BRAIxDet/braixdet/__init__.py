"""BRAIxDet for Detectron2: malignant breast-lesion detection from incompletely annotated mammograms."""
from .config import add_braixdet_config

__all__ = ["add_braixdet_config"]
