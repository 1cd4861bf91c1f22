"""tools/run_experiments.py's command line: several seeds of the pipeline (seeds.py), in
process or as submitit jobs (launcher.py), ending in the paper-style table.

``python -m braixdet.pipeline.experiments`` (console script ``braixdet-experiments``) is
tools/run_experiments.py installed: the same arguments, from any directory.
"""
import argparse
import sys

from ..cli import run_tool
from .core import add_pipeline_arguments
from .launcher import add_launcher_arguments, launch
from .seeds import DEFAULT_METHODS, run_experiments


def parse_args(argv=None, description=__doc__):
    """tools/run_experiments.py's arguments: the pipeline's, the launcher's and --seeds."""
    ap = argparse.ArgumentParser(description=description.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=description.split("\n\n", 1)[1])
    add_pipeline_arguments(ap)
    add_launcher_arguments(ap)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.set_defaults(out="output/experiments", methods=DEFAULT_METHODS)
    args = ap.parse_args(argv)
    if args.max_jobs < 0:
        ap.error(f"--max-jobs {args.max_jobs}: 0 (no cap) or a number of jobs")
    if args.max_jobs and args.launcher != "local":
        ap.error(f"--max-jobs caps the local launcher's jobs; with --launcher {args.launcher} "
                 "it would do nothing")
    return args


def run(args):
    """In process (default), or as submitit jobs (--launcher local/slurm, --dry-run)."""
    if args.launcher != "inprocess" or args.dry_run:
        return launch(args, args.seeds, args.out)
    return run_experiments(args, args.seeds, args.out)


def main(argv=None):
    return run_tool(lambda a: run(parse_args(a)), argv)


if __name__ == "__main__":
    sys.exit(main())
