"""Algorithm 1: GradCAM pseudo-boxes of the BRAIxMVCCL classifier for weakly labelled cancers.

  python tools/gradcam_pseudo_labels.py --config-file configs/MVCCL/mvccl.yaml \
      --weights output/mvccl/model_final.pth --out output/mvccl/gradcam_pseudo_boxes.json \
      DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM DATASETS.BRAIXDET.RATIO 1/8

Writes one JSON, image_id -> {"boxes": [[x0,y0,x1,y1] original DICOM px], "scores": [p]}, for
every weak training image with label 1 (stage 2 reads it as SSL.CAM_JSON), and prints how many
pseudo-boxes hit a lesion on the weak images whose boxes the protocol withheld. An interrupted
run resumes, unless weights, CAM settings or images changed (then it starts fresh).

With ``--evaluate DATASET`` it instead scores the GradCAM boxes of every image of DATASET as
detections (the "CAM only" row of the paper's ablation) and prints AP / FROC recall.
The heatmap method and layer are MODEL.BRAIXDET.CAM.METHOD / TARGET_LAYER (config overrides).

The pipeline's GradCAM stages run ``python -m braixdet.pipeline.gradcam_pseudo_labels``;
tools/gradcam_pseudo_labels.py is the same entry point.
"""
import argparse
import logging
import os
import sys

from detectron2.data import DatasetCatalog
from detectron2.modeling import build_model
from detectron2.utils.logger import setup_logger

from braixdet.cam import CamSettings, write_cam_boxes
from braixdet.cli import ToolError, run_tool
from braixdet.config import build_cfg, inference_cfg, register_datasets
from braixdet.data.mapper import MultiViewDatasetMapper
from braixdet.evaluation.cam_detector import evaluate_cam_detector, quality_line
from braixdet.utils.checkpoint import load_inference_weights

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


def main(argv=None):
    args = parse_args(argv)
    setup_logger(name="braixdet")
    if not (args.evaluate or args.out):
        raise ToolError("error: --out is required unless --evaluate is given")
    cfg = inference_cfg(build_cfg(args.config_file, args.opts), args.weights)
    names = register_datasets(cfg)
    settings = CamSettings.from_cfg(cfg, tau=args.tau)
    model = build_model(cfg)
    load_inference_weights(model, args.weights)
    model.eval()
    mapper = MultiViewDatasetMapper(cfg, is_train=False)
    logger.info("Algorithm 1 settings: %s", settings)
    if args.evaluate:
        out_dir = args.eval_out or os.path.join(cfg.OUTPUT_DIR, "cam_only", args.evaluate)
        return evaluate_cam_detector(cfg, model, mapper, settings, args.evaluate, out_dir,
                                     args.batch_size)
    dataset = args.dataset or names["train_weak"]
    dicts = [d for d in DatasetCatalog.get(dataset) if int(d["label"]) == 1]
    result = write_cam_boxes(args.out, model, mapper, dicts, settings, args.weights, dataset,
                             args.batch_size)
    meta = result["meta"]
    print(f"wrote {args.out}: {meta['num_images']} images, {meta['num_boxes']} boxes")
    if meta["quality"]["images_with_known_lesions"]:
        print(quality_line(meta["quality"]))
    return result


if __name__ == "__main__":
    sys.exit(run_tool(main))
