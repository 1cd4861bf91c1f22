"""``python -m braixdet.pipeline`` (or the ``braixdet-pipeline`` console script): the two-stage
BRAIxDet pipeline on one dataset and seed, each stage skipped when done.

  python -m braixdet.pipeline --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --num-gpus 8 --out output/cbis_r1_8_s0 [--methods cam_only faster_rcnn braixdet ...]

The same arguments as tools/run_pipeline.py, from any directory once the package is installed
(the configs ship with it: braixdet/model_zoo.py). SIGTERM/SIGINT stop the running stage (its
whole process group); re-run to continue.
"""
import argparse
import sys

from ..cli import run_tool
from .core import Pipeline, add_pipeline_arguments
from .core import __doc__ as PIPELINE_DOC


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m braixdet.pipeline",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=PIPELINE_DOC.split("\n\n", 1)[1])
    return add_pipeline_arguments(ap).parse_args(argv)


def run(argv=None):
    return Pipeline(parse_args(argv)).run_all()


def main(argv=None):
    """Exit status: a failed stage ends with its own error line, no traceback."""
    return run_tool(run, argv)


if __name__ == "__main__":
    sys.exit(main())
