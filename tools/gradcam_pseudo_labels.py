#!/usr/bin/env python
"""Algorithm 1: GradCAM pseudo-boxes of the BRAIxMVCCL classifier for weakly labelled cancers.

  python tools/gradcam_pseudo_labels.py --config-file configs/MVCCL/mvccl.yaml \
      --weights output/mvccl/model_final.pth --out output/mvccl/gradcam_pseudo_boxes.json \
      DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM DATASETS.BRAIXDET.RATIO 1/8

Writes one JSON, image_id -> {"boxes": [[x0,y0,x1,y1] original DICOM px], "scores": [p]},
for every weak training image with label 1 (stage 2 reads it as SSL.CAM_JSON). Progress is
appended to ``<out>.partial.jsonl`` so an interrupted run resumes where it stopped.

With ``--evaluate DATASET`` it instead scores GradCAM boxes of *every* image of DATASET as
detections (the "CAM only" row of the paper's stage ablation) and prints AP / FROC recall.
"""
import argparse
import json
import logging
import os
import sys

import torch
from detectron2.data import DatasetCatalog
from detectron2.modeling import build_model
from detectron2.structures import Boxes, Instances
from detectron2.utils.logger import setup_logger
from tqdm import tqdm

from braixdet.cam import (
    boxes_to_original,
    cam_boxes_from_heatmap,
    gradcam_heatmaps,
    scaled_area_limits,
)
from braixdet.data.mapper import MultiViewDatasetMapper
from braixdet.engine.setup import build_cfg, load_inference_weights, register_and_assign_datasets

logger = logging.getLogger("braixdet.gradcam")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", required=True, help="BRAIxMVCCL checkpoint")
    ap.add_argument("--out", help="output JSON (pseudo-label mode)")
    ap.add_argument("--dataset", default="", help="dataset to label (default: the weak set)")
    ap.add_argument("--evaluate", default="", help="score CAM boxes on this dataset instead")
    ap.add_argument("--eval-out", default="", help="evaluator output folder (--evaluate)")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--tau", type=float, default=None,
                    help="heatmap threshold τ (default MODEL.BRAIXDET.CAM.TAU)")
    ap.add_argument("opts", nargs=argparse.REMAINDER, help="config overrides KEY VALUE ...")
    return ap.parse_args(argv)


def iter_cam_boxes(model, mapper, dicts, batch_size, tau, cfg, desc):
    """Yield (dataset_dict, mapped_input, boxes_original (K,4) np, prob) per loadable image."""
    c = cfg.MODEL.BRAIXDET.CAM
    min_area, max_area = scaled_area_limits(cfg.INPUT.BRAIXDET.CANONICAL_SIZE,
                                            ref_size=tuple(c.REF_SIZE),
                                            limits=(c.MIN_AREA, c.MAX_AREA))
    for i in tqdm(range(0, len(dicts), batch_size), desc=desc, unit="batch"):
        chunk = dicts[i:i + batch_size]
        pairs = [(d, mapper(d)) for d in chunk]
        pairs = [(d, x) for d, x in pairs if x is not None]  # bad files: reported by the mapper
        if not pairs:
            continue
        heatmaps, probs = gradcam_heatmaps(model, [x for _, x in pairs])
        for (d, x), heat, prob in zip(pairs, heatmaps, probs):
            boxes = cam_boxes_from_heatmap(heat, tau=tau, min_area=min_area, max_area=max_area)
            yield d, x, boxes_to_original(boxes, x["transforms"]), float(prob)


def write_pseudo_labels(args, cfg, model, mapper, names):
    dataset = args.dataset or names["train_weak"]
    dicts = [d for d in DatasetCatalog.get(dataset) if int(d["label"]) == 1]
    partial = args.out + ".partial.jsonl"
    done = {}
    if os.path.exists(partial):  # resume: keep complete lines, drop a torn last line
        with open(partial) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break
                done[rec["image_id"]] = {"boxes": rec["boxes"], "scores": rec["scores"]}
        logger.info("resuming: %d of %d images already labelled", len(done), len(dicts))
    todo = [d for d in dicts if str(d["image_id"]) not in done]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(partial, "a") as f:
        for d, _, boxes, prob in iter_cam_boxes(model, mapper, todo, args.batch_size, args.tau,
                                                cfg, "GradCAM"):
            rec = {"image_id": str(d["image_id"]), "boxes": boxes.round(2).tolist(),
                   "scores": [prob] * len(boxes)}
            f.write(json.dumps(rec) + "\n")
            f.flush()
            done[rec["image_id"]] = {"boxes": rec["boxes"], "scores": rec["scores"]}
    result = {"meta": {"dataset": dataset, "tau": args.tau, "weights": args.weights,
                       "canonical_size": list(cfg.INPUT.BRAIXDET.CANONICAL_SIZE),
                       "num_images": len(done),
                       "num_boxes": sum(len(v["boxes"]) for v in done.values())},
              "images": done}
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, args.out)
    os.remove(partial)
    logger.info("wrote %s: %d images, %d boxes", args.out, result["meta"]["num_images"],
                result["meta"]["num_boxes"])
    return result


def evaluate_cam_detector(args, cfg, model, mapper):
    """CAM-only detector: GradCAM boxes of every image, scored by the classifier probability."""
    from braixdet.evaluation import MammoDetectionEvaluator

    out_dir = args.eval_out or os.path.join(cfg.OUTPUT_DIR, "cam_only", args.evaluate)
    evaluator = MammoDetectionEvaluator(args.evaluate, output_dir=out_dir,
                                        iou_thresh=cfg.TEST.BRAIXDET.IOU_THRESH,
                                        fppi=tuple(cfg.TEST.BRAIXDET.FROC_FPPI),
                                        center_hit=cfg.TEST.BRAIXDET.CENTER_HIT,
                                        distributed=False)
    evaluator.reset()
    dicts = DatasetCatalog.get(args.evaluate)
    for d, x, boxes, prob in iter_cam_boxes(model, mapper, dicts, args.batch_size, args.tau,
                                            cfg, "CAM detector"):
        inst = Instances((d["height"], d["width"]))
        inst.pred_boxes = Boxes(torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4))
        inst.scores = torch.full((len(boxes),), prob)
        inst.pred_classes = torch.zeros(len(boxes), dtype=torch.int64)
        evaluator.process([x], [{"instances": inst}])
    results = evaluator.evaluate()
    print(json.dumps(results, indent=1))
    return results


def main(argv=None):
    args = parse_args(argv)
    setup_logger(name="braixdet")
    cfg = build_cfg(args.config_file, args.opts)
    names = register_and_assign_datasets(cfg)
    if args.tau is None:
        args.tau = cfg.MODEL.BRAIXDET.CAM.TAU
    cfg.freeze()
    model = build_model(cfg)
    load_inference_weights(model, args.weights)
    model.eval()
    mapper = MultiViewDatasetMapper(cfg, is_train=False)
    if args.evaluate:
        return evaluate_cam_detector(args, cfg, model, mapper)
    if not args.out:
        sys.exit("--out is required unless --evaluate is given")
    return write_pseudo_labels(args, cfg, model, mapper, names)


if __name__ == "__main__":
    main()
