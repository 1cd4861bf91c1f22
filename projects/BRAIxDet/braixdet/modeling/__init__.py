"""BRAIxDet models; importing registers the backbones and meta-architectures with detectron2."""
from .backbone import (
    MultiViewBottomUp,
    TimmBackbone,
    build_braixdet_fpn_backbone,
    build_multiview_bottom_up,
    build_timm_backbone,
)
from .gcm import GlobalConsistencyModule
from .lcm import CrossViewAttention, LocalCoOccurrenceModule
from .mvccl import MVCCLClassifier
from .rcnn import (
    MultiViewRCNN,
    instances_to_original,
    load_classifier_weights,
    load_classifier_weights_from_cfg,
)

__all__ = [
    "TimmBackbone",
    "MultiViewBottomUp",
    "build_timm_backbone",
    "build_braixdet_fpn_backbone",
    "build_multiview_bottom_up",
    "CrossViewAttention",
    "LocalCoOccurrenceModule",
    "GlobalConsistencyModule",
    "MVCCLClassifier",
    "MultiViewRCNN",
    "instances_to_original",
    "load_classifier_weights",
    "load_classifier_weights_from_cfg",
]
