#!/usr/bin/env python
"""The paper's rows over several seeds on one dataset, ending in the paper-style table.

  python tools/run_experiments.py --dataset cbis_ddsm --root /data/CBIS-DDSM --ratio 1/8 \
      --seeds 0 1 2 --out output/cbis_r1_8 [--configs configs/demo] [--num-gpus 8]
  ... --launcher slurm --partition gpu --gpus-per-job 8 --timeout-min 1440 [--dry-run]

Per seed, the pipeline (tools/run_pipeline.py's arguments; default methods: the rows of the
paper's Table 6) into <out>/s<seed>/; then mean ± std over seeds, the classifiers' AUC and the
one-tailed Welch t-test of BRAIxDet against the second best row in <out>/summary.md and
summary.json (braixdet/pipeline/experiments.py). Re-running continues where it stopped.
``--launcher slurm|local``: one submitit job per (seed, stage) with the summary job last
(braixdet/pipeline/launcher.py); ``--dry-run`` prints the jobs and their GPU hours.
Installed: ``python -m braixdet.pipeline.experiments``, the same arguments.
"""
import sys

from braixdet.cli import run_tool
from braixdet.pipeline import experiments


def parse_args(argv=None):
    return experiments.parse_args(argv, description=__doc__)


def main(argv=None):
    return experiments.run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(run_tool(main))  # a failed stage: its own error line, no traceback
