#!/usr/bin/env python
"""The README's main job: the whole BRAIxDet method on a synthetic DICOM dataset, on a CPU.

  make demo     (10 min on a 2-core Intel Xeon)                       make demo QUICK=1   (2 min)
  python tools/run_demo.py --seeds 0 1 2               (3 seeds, every row incl. competitors:
                                                       the table as mean ± std, about 87 min)
Measured run times: docs/RESULTS.md §1.0a, §1.7 and §1.9. `--jobs N`: N stages at once.

What it runs and writes: braixdet/pipeline/demo.py. One seed shows no spread: rows within the
seed spread are not ranked. SIGTERM/SIGINT stop the running stage; `--resume` continues.
"""
import argparse
import sys

from braixdet.cli import run_tool
from braixdet.pipeline.demo import CEILING_ROW, run_demo
from braixdet.pipeline.methods import CAM_ONLY, METHODS


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="out")
    ap.add_argument("--quick", action="store_true", help="tiny run (about 2 minutes)")
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, help="one seed (default 0)")
    seeds.add_argument("--seeds", nargs="+", type=int,
                       help="several seeds: the table shows mean ± std over them")
    ap.add_argument("--methods", nargs="+", choices=[CAM_ONLY, *METHODS, CEILING_ROW],
                    help="the rows (default: the demo's four and the full-label ceiling for "
                         "one seed, every row for several)")
    ap.add_argument("--jobs", type=int,
                    help="stages at once, as local jobs (default: the cores / the demo configs' "
                         "NUM_THREADS, which each stage uses); the table does not depend on it")
    ap.add_argument("--resume", action="store_true",
                    help="keep previous outputs: finished stages are skipped, interrupted "
                         "training resumes (default: recompute everything but the data)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    seeds = args.seeds or [0 if args.seed is None else args.seed]
    return run_demo(args.out, quick=args.quick, seeds=seeds, resume=args.resume,
                    methods=args.methods, jobs=args.jobs)


if __name__ == "__main__":
    sys.exit(run_tool(main))  # a failed stage: its own error line, no traceback
