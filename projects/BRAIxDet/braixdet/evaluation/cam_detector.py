"""The "CAM only" detector of the paper's ablation (Table 6 row 1): Algorithm 1's boxes of every
image, scored by the classifier's probability, evaluated as detections; and the pseudo-box
quality line (tools/gradcam_pseudo_labels.py)."""
import json

import torch
from detectron2.data import DatasetCatalog
from detectron2.structures import Boxes, Instances

from ..cam import iter_cam_boxes
from .mammo_evaluator import MammoDetectionEvaluator


def quality_line(q):
    return (f"GradCAM pseudo-box quality on {q['images_with_known_lesions']} weak images with "
            f"withheld boxes: {100 * q['box_hit_rate']:.1f}% of {q['boxes']} boxes hit a lesion "
            f"(IoU >= 0.2), {100 * q['lesion_hit_rate']:.1f}% of {q['lesions']} lesions hit")


def evaluate_cam_detector(cfg, model, mapper, settings, dataset, out_dir, batch_size):
    """CAM-only detector: GradCAM boxes of every image, scored by the classifier probability."""
    t = cfg.TEST.BRAIXDET
    evaluator = MammoDetectionEvaluator(dataset, output_dir=out_dir, iou_thresh=t.IOU_THRESH,
                                        fppi=tuple(t.FROC_FPPI), center_hit=t.CENTER_HIT,
                                        distributed=False)
    evaluator.reset()
    for d, x, boxes, prob in iter_cam_boxes(model, mapper, DatasetCatalog.get(dataset),
                                            settings, batch_size, desc="CAM detector"):
        inst = Instances((d["height"], d["width"]))
        inst.pred_boxes = Boxes(torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4))
        inst.scores = torch.full((len(boxes),), prob)
        inst.pred_classes = torch.zeros(len(boxes), dtype=torch.int64)
        evaluator.process([x], [{"instances": inst}])
    results = evaluator.evaluate()
    print(json.dumps(results, indent=1))
    return results
