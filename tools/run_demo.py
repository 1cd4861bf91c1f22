#!/usr/bin/env python
"""The README's main job: the whole BRAIxDet method on a synthetic DICOM dataset, on a CPU.

  make demo            (about 15 min on 2 cores)      make demo QUICK=1   (about 3 min)

1. writes a synthetic screening dataset in the CBIS-DDSM layout (tools/make_synthetic_dataset.py)
2. stage 1: BRAIxMVCCL classifier; Algorithm 1 GradCAM pseudo-boxes; the "CAM only" detector
3. stage 2: BRAIxDet student-teacher at the 1/8 partially labelled protocol
4. the single-view Faster R-CNN baseline on the same split
5. evaluates all on the test split and prints a table like the paper's, with `out/demo/`
   holding metrics JSON, FROC curves (CSV + PNG) and overlay PNGs of test images.
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

DEMO = {  # (patients, rows, cols) of the synthetic set; iterations per stage
    "full": dict(patients=48, rows=512, cols=320, mvccl_iters=150, det_iters=240, size=(256, 128)),
    "quick": dict(patients=20, rows=256, cols=160, mvccl_iters=30, det_iters=30, size=(128, 64)),
}


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
    want = {"patients": spec["patients"], "rows": spec["rows"], "cols": spec["cols"], "seed": seed}
    if os.path.exists(marker) and json.load(open(marker)) == want:
        print(f"=== [data] reusing {root}")
        return
    from synthetic_mammo import make_synthetic_dataset

    shutil.rmtree(root, ignore_errors=True)
    print(f"=== [data] synthetic dataset: {spec['patients']} patients -> {root}", flush=True)
    make_synthetic_dataset(root, patients=spec["patients"], image_size=(spec["rows"], spec["cols"]),
                           lesion_rate=0.7, seed=seed, progress=True)
    with open(marker, "w") as f:
        json.dump(want, f)


def draw_overlays(out_dir, det_dir, n=4):
    """GT (blue) and BRAIxDet teacher detections (red) on a few malignant test images."""
    from braixdet.data.dicom import read_dicom_image
    from braixdet.evaluation.overlay import draw_overlay
    from braixdet.utils import safe_output_path

    found = sorted(os.path.join(d, "detections_coco.json") for d, _, files in os.walk(det_dir)
                   if "detections_coco.json" in files)
    teacher = [f for f in found if f"{os.sep}student{os.sep}" not in f]  # not student/ metrics
    if not teacher:
        return []
    det_file = teacher[0]
    dets = json.load(open(det_file))
    from detectron2.data import DatasetCatalog

    test = [d for d in DatasetCatalog.get("cbis_ddsm_test") if d.get("annotations")][:n]
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


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    spec = DEMO["quick" if args.quick else "full"]
    out = os.path.abspath(os.path.join(args.out, "demo_quick" if args.quick else "demo"))
    if not args.resume:
        shutil.rmtree(out, ignore_errors=True)
    root = os.path.join(os.path.abspath(args.out), "data_quick" if args.quick else "data")
    make_data(root, spec, args.seed)
    h, w = spec["size"]
    size = ["INPUT.BRAIXDET.CANONICAL_SIZE", f"({h}, {w})"]
    demo_cfg = os.path.join(REPO, "configs", "demo")
    pipe_args = run_pipeline.parse_args([
        "--dataset", "cbis_ddsm", "--root", root, "--ratio", "1/8", "--seed", str(args.seed),
        "--out", out, "--baseline", "--cam-only", "--num-gpus", "1",
        "--mvccl-config", os.path.join(demo_cfg, "MVCCL", "mvccl.yaml"),
        "--det-config", os.path.join(demo_cfg, "BRAIxDet", "braixdet.yaml"),
        "--baseline-config", os.path.join(demo_cfg, "baselines", "faster_rcnn.yaml"),
        "--opts", *size, "INPUT.BRAIXDET.CACHE_DIR",
        os.path.join(os.path.abspath(args.out), "cache"),  # survives re-runs (keyed by params)
        "--mvccl-opts", "SOLVER.MAX_ITER", str(spec["mvccl_iters"]),
        "--det-opts", "SOLVER.MAX_ITER", str(spec["det_iters"]),
        *(["TEST.BRAIXDET.EVAL_STUDENT", "False"] if args.quick else [])])
    pipeline = run_pipeline.Pipeline(pipe_args)
    summary = pipeline.run_all()

    from braixdet.engine.setup import build_cfg, register_and_assign_datasets

    # the pipeline's own dataset overrides, so the overlays see the same registered split
    cfg = build_cfg(os.path.join(demo_cfg, "BRAIxDet", "braixdet.yaml"),
                    [*pipeline.common, "OUTPUT_DIR", os.path.join(out, "overlays_tmp"),
                     "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", ""])
    register_and_assign_datasets(cfg)
    overlays = draw_overlays(os.path.join(out, "overlays"), os.path.join(out, "braixdet"))
    table = run_pipeline.format_table(summary["results"])
    minutes = (time.time() - t0) / 60
    report = (f"# BRAIxDet demo ({'quick' if args.quick else 'full'})\n\n"
              f"Synthetic CBIS-DDSM-layout data: {spec['patients']} patients, "
              f"{spec['rows']}x{spec['cols']} DICOMs; canonical input {h}x{w}; "
              f"1/8 partially labelled protocol, seed {args.seed}; "
              f"{spec['mvccl_iters']} stage-1 and {spec['det_iters']} stage-2 iterations on CPU; "
              f"total {minutes:.1f} min.\n\n{table}\n\nOverlays: "
              + ", ".join(os.path.relpath(p, out) for p in overlays) + "\n")
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report)
    print("\n" + report)
    print(f"outputs in {out}")
    return summary



if __name__ == "__main__":
    main()
