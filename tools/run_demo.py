#!/usr/bin/env python
"""The README's main job: the whole BRAIxDet method on a synthetic DICOM dataset, on a CPU.

  make demo            (about 20 min on 2 cores)      make demo QUICK=1   (about 3 min)

1. writes a synthetic screening dataset in the CBIS-DDSM layout (synthetic_mammo)
2. tools/run_pipeline.py with the demo configs (configs/demo/: the paper's configs at 256x128,
   offline ImageNet EfficientNet-Lite0, short schedules): BRAIxMVCCL and a single-view
   classifier; Algorithm 1 pseudo-boxes and their hit rate; the rows CAM only, Faster R-CNN,
   Mean Teacher (multi-view SSL without GradCAM) and BRAIxDet at the 1/8 protocol
3. prints the table (plus the classifiers' AUC) and writes `out/demo/`: results.md/json,
   metrics, FROC curves (CSV + PNG) and overlay PNGs of test images.
The numbers are whatever this small, short CPU run measures; see the README for context.
"""
import argparse
import json
import os
import shutil
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))

import run_pipeline  # noqa: E402

METHODS = ["cam_only", "faster_rcnn", "mean_teacher", "braixdet"]
# synthetic set, canonical input, schedules (stage-1 / stage-2 epochs); see README "The demo"
DEMO = {
    "full": dict(patients=160, rows=512, cols=320, separation=2.0, size=(256, 128),
                 stage1_epochs=5.0, det_epochs=3.0),
    "quick": dict(patients=24, rows=256, cols=160, separation=2.0, size=(128, 64),
                  stage1_epochs=2.0, det_epochs=1.0),
}
CHANCE_AUC = 0.6  # below this the classifier learned nothing: say so next to the table


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick", action="store_true", help="tiny run (about 3 minutes)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true",
                    help="keep previous outputs: finished stages are skipped, interrupted "
                         "training resumes (default: recompute everything but the data)")
    return ap.parse_args(argv)


def make_data(root, spec, seed):
    """Generate the synthetic dataset once; a marker beside it (not inside) records the spec."""
    marker = root.rstrip("/") + ".json"
    want = {k: spec[k] for k in ("patients", "rows", "cols", "separation")} | {"seed": seed}
    if os.path.exists(marker) and json.load(open(marker)) == want:
        print(f"=== [data] reusing {root}")
        return
    from synthetic_mammo import make_synthetic_dataset

    shutil.rmtree(root, ignore_errors=True)
    print(f"=== [data] synthetic dataset: {spec['patients']} patients -> {root}", flush=True)
    make_synthetic_dataset(root, patients=spec["patients"], image_size=(spec["rows"], spec["cols"]),
                           lesion_rate=0.7, seed=seed, separation=spec["separation"],
                           progress=True)
    with open(marker, "w") as f:
        json.dump(want, f)


def draw_overlays(out_dir, det_dir, test_name, n=4):
    """GT (blue) and BRAIxDet teacher detections (red) on a few malignant test images."""
    from detectron2.data import DatasetCatalog

    from braixdet.data.dicom import read_dicom_image
    from braixdet.evaluation.overlay import draw_overlay
    from braixdet.utils import safe_output_path

    det_file = os.path.join(det_dir, "inference", "model", test_name, "detections_coco.json")
    if not os.path.exists(det_file):
        return []
    dets = json.load(open(det_file))
    test = [d for d in DatasetCatalog.get(test_name) if d.get("annotations")][:n]
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for d in test:
        img, _ = read_dicom_image(d["file_name"])
        mine = [r for r in dets if r.get("braixdet_image_id") == str(d["image_id"])]
        mine = sorted(mine, key=lambda r: -r["score"])[:3]
        boxes = [[x, y, x + w, y + h] for x, y, w, h in (r["bbox"] for r in mine)]
        png = safe_output_path(out_dir, d["image_id"], ".png")
        draw_overlay(img, [a["bbox"] for a in d["annotations"]], boxes,
                     [r["score"] for r in mine], png)
        written.append(png)
    return written


def report(summary, spec, args, minutes, overlays, out):
    h, w = spec["size"]
    lines = [f"# BRAIxDet demo ({'quick' if args.quick else 'full'})", "",
             f"Synthetic CBIS-DDSM-layout data: {spec['patients']} patients, "
             f"{spec['rows']}x{spec['cols']} DICOMs (lesion separation {spec['separation']}); "
             f"canonical input {h}x{w}; 1/8 partially labelled protocol, seed {args.seed}; "
             f"{spec['stage1_epochs']:g} stage-1 and {spec['det_epochs']:g} stage-2 epochs on "
             f"CPU; total {minutes:.1f} min.", "",
             run_pipeline.format_table(summary["results"]), "",
             run_pipeline.format_classifiers(summary["classifiers"])]
    q = summary.get("cam_quality")
    if q:
        lines += ["", f"GradCAM pseudo-boxes on D_w: {100 * q['box_hit_rate']:.1f}% of "
                  f"{q['boxes']} boxes hit a lesion, {100 * q['lesion_hit_rate']:.1f}% of "
                  f"{q['lesions']} lesions hit (IoU >= 0.2)."]
    weak = [n for n, m in summary["classifiers"].items()
            if (m.get("test", {}).get("AUC") or 0.0) < CHANCE_AUC]
    if weak:
        lines += ["", f"**Warning**: test AUC below {CHANCE_AUC} for {', '.join(weak)}: the "
                  "classifier is near chance, so its GradCAM boxes and the detectors it "
                  "initialises carry little signal in this run."]
    lines += ["", "Overlays: " + ", ".join(os.path.relpath(p, out) for p in overlays)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    spec = DEMO["quick" if args.quick else "full"]
    base = os.path.abspath(args.out)
    out = os.path.join(base, "demo_quick" if args.quick else "demo")
    if not args.resume:
        shutil.rmtree(out, ignore_errors=True)
    root = os.path.join(base, "data_quick" if args.quick else "data")
    make_data(root, spec, args.seed)
    h, w = spec["size"]
    pipe_args = run_pipeline.parse_args([
        "--dataset", "cbis_ddsm", "--root", root, "--ratio", "1/8", "--seed", str(args.seed),
        "--out", out, "--configs", os.path.join(REPO, "configs", "demo"),
        "--methods", *METHODS, "--num-gpus", "1",
        "--opts", "INPUT.BRAIXDET.CANONICAL_SIZE", f"({h}, {w})",
        "INPUT.BRAIXDET.CACHE_DIR", os.path.join(base, "cache"),  # survives re-runs
        "--stage1-opts", "SOLVER.BRAIXDET.EPOCHS", str(spec["stage1_epochs"]),
        "--det-opts", "SOLVER.BRAIXDET.EPOCHS", str(spec["det_epochs"])])
    pipeline = run_pipeline.Pipeline(pipe_args)
    summary = pipeline.run_all()

    from braixdet.engine.setup import build_cfg, register_and_assign_datasets

    # the pipeline's own dataset overrides, so the overlays see the same registered split
    cfg = build_cfg(os.path.join(REPO, "configs", "demo", "BRAIxDet", "braixdet.yaml"),
                    [*pipeline.common, "OUTPUT_DIR", os.path.join(out, "overlays_tmp")])
    register_and_assign_datasets(cfg)
    overlays = draw_overlays(os.path.join(out, "overlays"), pipeline.dir("braixdet"),
                             pipeline.test_name())
    text = report(summary, spec, args, (time.time() - t0) / 60, overlays, out)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(text)
    print("\n" + text)
    print(f"outputs in {out}")
    return summary


if __name__ == "__main__":
    main()
