#!/usr/bin/env python
"""The two-stage BRAIxDet pipeline on one dataset and seed, each stage skipped when done.

  python tools/run_pipeline.py --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --num-gpus 8 --out output/cbis_r1_8_s0 [--methods cam_only faster_rcnn braixdet ...]

The stages, the methods (rows) and how a re-run resumes: braixdet/pipeline (package).
SIGTERM/SIGINT stop the running stage (its whole process group); re-run to continue.
"""
import argparse
import sys

from braixdet.engine.preflight import run_tool
from braixdet.pipeline import Pipeline, add_pipeline_arguments
from braixdet.pipeline.core import __doc__ as PIPELINE_DOC


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=PIPELINE_DOC.split("\n\n", 1)[1])
    return add_pipeline_arguments(ap).parse_args(argv)


def main(argv=None):
    return Pipeline(parse_args(argv)).run_all()


if __name__ == "__main__":
    sys.exit(run_tool(main))  # a failed stage: its own error line, no traceback
