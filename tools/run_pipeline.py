#!/usr/bin/env python
"""The two-stage BRAIxDet pipeline on one dataset and seed, each stage skipped when done.

  python tools/run_pipeline.py --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --num-gpus 8 --out output/cbis_r1_8_s0 [--methods cam_only faster_rcnn braixdet ...]

The stages, the methods (rows) and how a re-run resumes: braixdet/pipeline (package); the same
entry point installed: ``python -m braixdet.pipeline``.
SIGTERM/SIGINT stop the running stage (its whole process group); re-run to continue.
"""
import sys

from braixdet.cli import run_tool
from braixdet.pipeline import Pipeline  # noqa: F401 - tests build pipelines from this tool
from braixdet.pipeline.__main__ import parse_args
from braixdet.pipeline.__main__ import run as main

__all__ = ["main", "parse_args"]

if __name__ == "__main__":
    sys.exit(run_tool(main))  # a failed stage: its own error line, no traceback
