"""BRAIxDet evaluation: numpy AP / FROC, detectron2 evaluators, breast and exam scores."""
from .classification_evaluator import ClassificationEvaluator, classification_metrics
from .mammo_evaluator import MammoDetectionEvaluator, build_evaluator, plot_froc
from .metrics import average_precision, box_iou_coco, froc, match_detections

__all__ = [
    "ClassificationEvaluator",
    "MammoDetectionEvaluator",
    "average_precision",
    "box_iou_coco",
    "build_evaluator",
    "classification_metrics",
    "froc",
    "match_detections",
    "plot_froc",
]
