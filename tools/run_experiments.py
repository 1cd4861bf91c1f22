#!/usr/bin/env python
"""The paper's rows over several seeds on one dataset, ending in the paper-style table.

  python tools/run_experiments.py --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --seeds 0 1 2 --out output/cbis_r1_8 [--configs configs/demo] [--num-gpus 8]

Per seed, the pipeline (tools/run_pipeline.py's arguments; default methods: the rows of the
paper's Table 6) into <out>/s<seed>/; then mean ± std over seeds, the classifiers' AUC and the
one-tailed Welch t-test of BRAIxDet against the second best row in <out>/summary.md and
summary.json (braixdet/pipeline/experiments.py). Re-running continues where it stopped.
"""
import argparse
import sys

from braixdet.engine.preflight import run_tool
from braixdet.pipeline import add_pipeline_arguments
from braixdet.pipeline.experiments import DEFAULT_METHODS, run_experiments


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    add_pipeline_arguments(ap)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.set_defaults(out="output/experiments", methods=DEFAULT_METHODS)
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    return run_experiments(args, args.seeds, args.out)


if __name__ == "__main__":
    sys.exit(run_tool(main))  # a failed stage: its own error line, no traceback
