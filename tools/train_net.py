#!/usr/bin/env python
"""Train or evaluate any BRAIxDet stage: the config picks the trainer (engine/trainers.py).

  python tools/train_net.py --config-file configs/MVCCL/mvccl.yaml \
      DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM OUTPUT_DIR out/mvccl
  python tools/train_net.py --config-file configs/BRAIxDet/braixdet.yaml --num-gpus 8 \
      DATASETS.BRAIXDET.ROOT /data/CBIS-DDSM DATASETS.BRAIXDET.RATIO 1/8 \
      MODEL.BRAIXDET.INIT_FROM_CLASSIFIER out/mvccl/model_export.pth SSL.CAM_JSON ...
  ... --eval-only MODEL.WEIGHTS out/braixdet/model_export.pth  (evaluates the teacher)
  ... --resume                                                  (continues where it stopped)

Before anything is written, the main process locks OUTPUT_DIR (a second run on the same folder
is refused) and checks what can be checked before training (datasets non-empty, init files
readable, OUTPUT_DIR writable with room for a checkpoint). A failure ends with one line
``error: ...`` naming its cause; the full traceback goes to OUTPUT_DIR/log.txt.
"""
import sys

from braixdet.cli import run_tool
from braixdet.pipeline.train_net import (  # noqa: F401 - the tool's entry points
    append_to_log,
    cli,
    launch_training,
    main,
    setup,
)

if __name__ == "__main__":
    sys.exit(run_tool(launch_training, log=append_to_log))
