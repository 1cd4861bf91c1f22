#!/usr/bin/env python
"""Where do Algorithm 1's boxes lose the lesions? Every heatmap method x target layer on the
malignant images whose boxes are known, from one trained BRAIxMVCCL checkpoint.

  python benchmarks/experiment_cam_layers.py --config-file configs/demo/MVCCL/mvccl.yaml \
      --weights out/demo/mvccl/model_final.pth --datasets cbis_ddsm_train_full_full_s0 \
      cbis_ddsm_test DATASETS.BRAIXDET.ROOT out/data DATASETS.BRAIXDET.PROTOCOL full ...

Per (method, layer): the fraction of lesions hit by a box (IoU >= 0.2), of boxes on a lesion,
the pointing game (the heatmap's maximum inside a lesion box, 4 px tolerance) and the median box
area against the median lesion area, and the lesions hit per size bucket: the lesion box's side
sqrt(w·h) in the canonical frame relative to the canonical width (--size-edges). With
--view-agreement δ ..., each heatmap is also scored after the view-agreement filter. Not part of
`make bench` (it needs a trained classifier); the GradCAM table of docs/RESULTS.md §2 comes from it.
"""
import argparse
import os

import numpy as np
import torch
from detectron2.data import DatasetCatalog
from detectron2.modeling import build_model

from braixdet.cam import (
    FUSED_LAYERS,
    CamSettings,
    box_depths,
    cam_box_quality,
    cam_boxes_from_heatmap,
    depth_profile,
    gradcam_heatmaps,
    lesions_hit,
    nipple_column,
    view_agreement_filter,
)
from braixdet.config import build_cfg, inference_cfg, register_datasets
from braixdet.data.mapper import MultiViewDatasetMapper
from braixdet.utils.checkpoint import load_inference_weights

VARIANTS = [(m, layer) for m in ("gradcam", "layercam") for layer in ("res5", "res4", "res3")]
VARIANTS.append(("layercam", FUSED_LAYERS))
SIZE_EDGES = (0.10, 0.14)  # our choice: each bucket holds lesions on the dev sets and the demo


def lesion_sides(gts, canonical_width):
    """Side sqrt(w·h) of each XYXY lesion box relative to the canonical width."""
    gts = np.asarray(gts, float).reshape(-1, 4)
    return np.sqrt((gts[:, 2] - gts[:, 0]) * (gts[:, 3] - gts[:, 1])) / float(canonical_width)


def bucket_names(edges):
    pct = [f"{100 * e:g}%" for e in edges]
    return ([f"<{pct[0]}"] + [f"{a}-{b}" for a, b in zip(pct, pct[1:])] + [f">={pct[-1]}"])


def hits_by_size(boxes, inputs, edges, canonical_width):
    """Per size bucket (see bucket_names): (lesions hit, lesions)."""
    hit, total = np.zeros(len(edges) + 1, int), np.zeros(len(edges) + 1, int)
    for x in inputs:
        gts = x["instances"].gt_boxes.tensor.numpy()
        idx = np.digitize(lesion_sides(gts, canonical_width), edges)
        np.add.at(total, idx, 1)
        np.add.at(hit, idx, lesions_hit(boxes[str(x["image_id"])], gts).astype(int))
    return hit, total


def evaluate(model, inputs, settings, method, layer, edges=SIZE_EDGES, pairing=(), deltas=()):
    """Quality of one heatmap's boxes; with ``deltas`` also after the view-agreement filter
    (``pairing``: the dataset dicts, whose aux_image_id pairs the views): {δ: quality}."""
    boxes, points, areas, records = {}, 0, [], {}
    for x in inputs:
        heat, _ = gradcam_heatmaps(model, [x], method, layer)
        gts = x["instances"].gt_boxes.tensor.numpy()
        yy, xx = np.unravel_index(heat[0].argmax(), heat[0].shape)
        points += any(b[0] - 4 <= xx <= b[2] + 4 and b[1] - 4 <= yy <= b[3] + 4 for b in gts)
        b = cam_boxes_from_heatmap(heat[0], settings.tau, settings.min_area, settings.max_area)
        boxes[str(x["image_id"])] = b
        areas += [float((c[2] - c[0]) * (c[3] - c[1])) for c in b]
        if deltas:
            nipple = nipple_column(x["image"].numpy())
            records[str(x["image_id"])] = {"boxes": b.tolist(), "scores": [1.0] * len(b),
                                           "depths": box_depths(b, nipple).tolist(),
                                           "profile": depth_profile(heat[0], nipple)}
    # canonical-frame GT, so the quality is measured where the heatmap lives
    dicts = [{"image_id": str(x["image_id"]), "annotations": [
        {"bbox": g.tolist(), "bbox_mode": 0} for g in x["instances"].gt_boxes.tensor.numpy()]}
        for x in inputs]

    def quality(by_image):
        q = cam_box_quality(by_image, dicts)
        q["by_size"] = hits_by_size(by_image, inputs, edges, settings.canonical_size[1])
        return q

    agreed = {}
    for delta in deltas:
        kept, _ = view_agreement_filter(records, pairing, delta, settings.tau)
        agreed[delta] = quality({k: np.asarray(v["boxes"]).reshape(-1, 4)
                                 for k, v in kept.items()})
    return (quality(boxes), points / max(1, len(inputs)),
            float(np.median(areas)) if areas else 0.0, agreed)


def table_row(name, q, point="–", area="–"):
    per = " | ".join(f"{100 * h / t:.0f}% ({t})" if t else "– (0)" for h, t in zip(*q["by_size"]))
    return (f"| {name} | {100 * q['lesion_hit_rate']:.0f}% | {per} | "
            f"{100 * q['box_hit_rate']:.0f}% ({q['boxes']}) | {point} | {area} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", required=True)
    ap.add_argument("--datasets", nargs="+", required=True, help="registered names")
    ap.add_argument("--out", default="", help="also write the table to this markdown file")
    ap.add_argument("--size-edges", nargs="+", type=float, default=list(SIZE_EDGES),
                    help="lesion-size bucket edges (side / canonical width), increasing")
    ap.add_argument("--variants", nargs="+", default=[f"{m}:{la}" for m, la in VARIANTS],
                    help="method:layer pairs to score (default: all)")
    ap.add_argument("--view-agreement", nargs="*", type=float, default=[],
                    help="also score each heatmap after the view-agreement filter with these δ")
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, (os.cpu_count() or 2)))
    cfg = inference_cfg(build_cfg(args.config_file, [
        *args.opts, "MODEL.BRAIXDET.OUT_FEATURES", '["res3", "res4", "res5"]']), args.weights)
    register_datasets(cfg)
    model = build_model(cfg)
    load_inference_weights(model, args.weights)
    model.eval()
    mapper = MultiViewDatasetMapper(cfg, is_train=False)
    settings = CamSettings.from_cfg(cfg)
    lines = []
    for name in args.datasets:
        dicts = [d for d in DatasetCatalog.get(name) if d["label"] == 1 and d.get("annotations")]
        inputs = [x for x in map(mapper, dicts) if x is not None]
        gts = [x["instances"].gt_boxes.tensor.numpy() for x in inputs]
        gt_area = np.median([float((g[2] - g[0]) * (g[3] - g[1])) for b in gts for g in b])
        sides = np.concatenate([lesion_sides(b, settings.canonical_size[1]) for b in gts])
        buckets = bucket_names(args.size_edges)
        lines += [f"\n{name}: {len(inputs)} malignant images, median lesion box "
                  f"{gt_area:.0f} px² at {tuple(settings.canonical_size)}, median side "
                  f"{100 * np.median(sides):.1f}% of the canonical width", "",
                  "| heatmap | lesions hit | " + " | ".join(f"hit {b}" for b in buckets)
                  + " | boxes on a lesion | pointing game | median box px² |",
                  "|---|---|" + "---|" * len(buckets) + "---|---|---|"]
        variants = [tuple(v.split(":", 1)) for v in args.variants]
        rows = 0
        for method, layer in variants:
            q, point, area, agreed = evaluate(model, inputs, settings, method, layer,
                                              args.size_edges, dicts, args.view_agreement)
            lines.append(table_row(f"{method} {layer}", q, f"{point:.2f}", f"{area:.0f}"))
            lines += [table_row(f"{method} {layer}, view agreement δ={d:g}", qa)
                      for d, qa in agreed.items()]
            rows += 1 + len(agreed)
        print("\n".join(lines[-rows - 4:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    main()
