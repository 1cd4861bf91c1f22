#!/usr/bin/env python
"""Algorithm 1: GradCAM pseudo-boxes of the BRAIxMVCCL classifier for weakly labelled cancers.

  python tools/gradcam_pseudo_labels.py --config-file configs/MVCCL/mvccl.yaml \
      --weights output/mvccl/model_export.pth --out output/mvccl/gradcam_pseudo_boxes.json \
      DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM DATASETS.BRAIXDET.RATIO 1/8

Writes one JSON, image_id -> {"boxes": [[x0,y0,x1,y1] original DICOM px], "scores": [p]}, for
every weak training image with label 1 (stage 2 reads it as SSL.CAM_JSON), and prints how many
pseudo-boxes hit a lesion on the weak images whose boxes the protocol withheld. An interrupted
run resumes, unless weights, CAM settings or images changed (then it starts fresh).

With ``--evaluate DATASET`` it instead scores the GradCAM boxes of every image of DATASET as
detections (the "CAM only" row of the paper's ablation) and prints AP / FROC recall.
The heatmap method and layer are MODEL.BRAIXDET.CAM.METHOD / TARGET_LAYER (config overrides).
"""
from braixdet.pipeline.gradcam_pseudo_labels import main, parse_args  # noqa: F401

if __name__ == "__main__":
    main()
