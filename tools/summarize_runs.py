#!/usr/bin/env python
"""Summarise several runs per method: mean ± std over seeds and a t-test against a baseline.

Runs are metrics files (the evaluator's metrics.json, {"bbox": {"AP20": ..}}; a flat
{"AP20": ..} dict; or detectron2's training log metrics.json, JSON lines, whose last record with
"bbox/AP20" is used) or run directories searched for such a file. Tag them with a method name:

    python tools/summarize_runs.py --baseline FasterRCNN \\
        --run "BRAIxDet=out/bx_s0/inference/test/metrics.json" --run "BRAIxDet=out/bx_s1" \\
        --run "FasterRCNN=out/frcnn_s0" --run "FasterRCNN=out/frcnn_s1"
    python tools/summarize_runs.py --baseline FasterRCNN \\
        --glob "out/*/inference/*/metrics.json" --regex "out/(?P<method>[^_/]+)_s\\d+/"

Per method: mean ± std (ddof=1) of each metric (default AP20 and R@0.5) and the p-value of a
one-tailed Welch t-test (scipy.stats.ttest_ind(method, baseline, equal_var=False,
alternative="greater")) that the method beats the baseline. Printed, and saved as
<out>/summary.csv and <out>/summary.md.
"""
import argparse
import sys
from collections import OrderedDict

from braixdet.cli import run_tool
from braixdet.pipeline.results import (  # noqa: F401 - load_metrics, collect_runs: the API
    METRICS,
    collect_runs,
    load_metrics,
    summarize,
    write_summary,
)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--run", action="append", default=[], metavar="METHOD=PATH")
    ap.add_argument("--glob", help="glob of metrics files or run dirs (with --regex)")
    ap.add_argument("--regex", help="regex naming the method of each globbed path")
    ap.add_argument("--baseline", required=True, help="method the others are tested against")
    ap.add_argument("--metrics", nargs="+", default=list(METRICS))
    ap.add_argument("--out", default="out/summary", help="folder for summary.csv / summary.md")
    args = ap.parse_args(argv)

    runs = collect_runs(args.run, args.glob, args.regex)
    if not runs:
        ap.error("no runs: give --run METHOD=PATH or --glob with --regex")
    values = OrderedDict()
    for method, path in runs:
        values.setdefault(method, []).append(load_metrics(path, args.metrics))
    rows = summarize(values, args.baseline, args.metrics)
    print(write_summary(rows, args.out, args.metrics, args.baseline))
    print(f"\nwrote {args.out}/summary.csv and summary.md", file=sys.stderr)
    return rows


if __name__ == "__main__":
    sys.exit(run_tool(main))
