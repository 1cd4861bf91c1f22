#!/usr/bin/env python
"""Where do Algorithm 1's boxes lose the lesions? Every heatmap method x target layer on the
malignant images whose boxes are known, from one trained BRAIxMVCCL checkpoint.

  python benchmarks/experiment_cam_layers.py --config-file configs/demo/MVCCL/mvccl.yaml \
      --weights out/demo/mvccl/model_final.pth --datasets cbis_ddsm_train_full_full_s0 \
      cbis_ddsm_test DATASETS.BRAIXDET.ROOT out/data DATASETS.BRAIXDET.PROTOCOL full ...

Per (method, layer): the fraction of lesions hit by a box (IoU >= 0.2), of boxes on a lesion,
the pointing game (the heatmap's maximum inside a lesion box, 4 px tolerance) and the median box
area against the median lesion area. Not part of `make bench` (it needs a trained classifier);
the GradCAM table of docs/RESULTS.md §2 comes from it.
"""
import argparse
import os

import numpy as np
import torch
from detectron2.data import DatasetCatalog
from detectron2.modeling import build_model

from braixdet.data.mapper import MultiViewDatasetMapper
from braixdet.engine.setup import build_cfg, load_inference_weights, register_and_assign_datasets
from braixdet.ssl.cam_boxes import (
    CamSettings,
    cam_box_quality,
    cam_boxes_from_heatmap,
    gradcam_heatmaps,
)

VARIANTS = [(m, layer) for m in ("gradcam", "layercam") for layer in ("res5", "res4", "res3")]


def evaluate(model, inputs, settings, method, layer):
    boxes, points, areas = {}, 0, []
    for x in inputs:
        heat, _ = gradcam_heatmaps(model, [x], method, layer)
        gts = x["instances"].gt_boxes.tensor.numpy()
        yy, xx = np.unravel_index(heat[0].argmax(), heat[0].shape)
        points += any(b[0] - 4 <= xx <= b[2] + 4 and b[1] - 4 <= yy <= b[3] + 4 for b in gts)
        b = cam_boxes_from_heatmap(heat[0], settings.tau, settings.min_area, settings.max_area)
        boxes[str(x["image_id"])] = b
        areas += [float((c[2] - c[0]) * (c[3] - c[1])) for c in b]
    # canonical-frame GT, so the quality is measured where the heatmap lives
    dicts = [{"image_id": str(x["image_id"]), "annotations": [
        {"bbox": g.tolist(), "bbox_mode": 0} for g in x["instances"].gt_boxes.tensor.numpy()]}
        for x in inputs]
    q = cam_box_quality(boxes, dicts)
    return q, points / max(1, len(inputs)), float(np.median(areas)) if areas else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--datasets", nargs="+", required=True, help="registered names")
    ap.add_argument("--out", default="", help="also write the table to this markdown file")
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    cfg = build_cfg(args.config_file, [*args.opts, "MODEL.WEIGHTS", args.weights,
                                       "MODEL.BRAIXDET.OUT_FEATURES", '["res3", "res4", "res5"]'])
    register_and_assign_datasets(cfg)
    model = build_model(cfg)
    load_inference_weights(model, args.weights)
    model.eval()
    mapper = MultiViewDatasetMapper(cfg, is_train=False)
    settings = CamSettings.from_cfg(cfg)
    lines = []
    for name in args.datasets:
        inputs = [x for x in (mapper(d) for d in DatasetCatalog.get(name)
                              if d["label"] == 1 and d.get("annotations")) if x is not None]
        gt_area = np.median([float((g[2] - g[0]) * (g[3] - g[1])) for x in inputs
                             for g in x["instances"].gt_boxes.tensor.numpy()])
        lines += [f"\n{name}: {len(inputs)} malignant images, median lesion box "
                  f"{gt_area:.0f} px² at {tuple(settings.canonical_size)}", "",
                  "| heatmap | lesions hit | boxes on a lesion | pointing game | median box px² |",
                  "|---|---|---|---|---|"]
        for method, layer in VARIANTS:
            q, point, area = evaluate(model, inputs, settings, method, layer)
            lines.append(f"| {method} {layer} | {100 * q['lesion_hit_rate']:.0f}% | "
                         f"{100 * q['box_hit_rate']:.0f}% ({q['boxes']}) | {point:.2f} | "
                         f"{area:.0f} |")
        print("\n".join(lines[-len(VARIANTS) - 4:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
