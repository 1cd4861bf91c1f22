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
import csv
import glob
import json
import math
import os
import re
import sys
from collections import OrderedDict

import numpy as np
from scipy import stats

DEFAULT_METRICS = ("AP20", "R@0.5")


def _flat(d):
    """{"bbox": {"AP20": x}} or {"bbox/AP20": x} or {"AP20": x} -> {"AP20": x}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update({kk: vv for kk, vv in v.items() if not isinstance(vv, dict)})
        elif "/" in k:
            out[k.split("/", 1)[1]] = v
        else:
            out.setdefault(k, v)
    return out


def load_metrics(path, metrics=DEFAULT_METRICS):
    """Metric dict of one run: a metrics file, or a directory searched recursively for
    *metrics*.json files having the metrics; evaluator outputs ({"bbox": {...}}) are preferred
    over training logs (flat "bbox/AP20" keys); more than one candidate left is an error."""
    if not os.path.isdir(path):
        return _load_file(path, metrics)[0]
    found = []
    for f in sorted(glob.glob(os.path.join(path, "**", "*metrics*.json"), recursive=True)):
        try:
            found.append((f, *_load_file(f, metrics)))
        except (ValueError, OSError):
            continue
    single = [x for x in found if not x[2]]
    found = single or found
    if len(found) != 1:
        names = ", ".join(x[0] for x in found) or "none"
        raise ValueError(f"{path}: expected one metrics file with {list(metrics)}, found: "
                         f"{names}; pass the file itself")
    return found[0][1]


def _load_file(path, metrics):
    """-> (metric dict, is_log): is_log unless the metrics sit in a nested dict as in the
    evaluator's {"bbox": {...}} (detectron2 logs have flat "bbox/AP20" keys)."""
    with open(path) as f:
        text = f.read()
    try:
        records = [json.loads(text)]
    except json.JSONDecodeError:  # detectron2 JSONWriter: one JSON object per line
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    for rec in reversed(records):
        flat = _flat(rec) if isinstance(rec, dict) else {}
        if all(m in flat for m in metrics):
            vals = {m: (float("nan") if flat[m] is None else float(flat[m])) for m in metrics}
            nested = any(isinstance(v, dict) and all(m in v for m in metrics)
                         for v in rec.values())
            return vals, not nested
    raise ValueError(f"{path}: no record with all of {list(metrics)}")


def collect_runs(run_args=(), glob_pattern=None, regex=None):
    """[(method, path)] from "METHOD=PATH" strings and/or a glob whose paths a regex tags
    (named group "method", else group 1)."""
    runs = []
    for r in run_args:
        if "=" not in r:
            raise ValueError(f"--run expects METHOD=PATH, got {r!r}")
        method, path = r.split("=", 1)
        runs.append((method.strip(), path.strip()))
    if glob_pattern:
        if not regex:
            raise ValueError("--glob needs --regex to name the method of each path")
        rx = re.compile(regex)
        for path in sorted(glob.glob(glob_pattern, recursive=True)):
            m = rx.search(path)
            if m is None:
                continue
            runs.append((m.group("method") if "method" in rx.groupindex else m.group(1), path))
    return runs


def summarize(values, baseline, metrics=DEFAULT_METRICS):
    """values: {method: [ {metric: x}, ... ]} -> rows (OrderedDicts), baseline first.

    p-values: one-tailed Welch t-test method > baseline (NaN with < 2 runs on either side or
    for the baseline itself).
    """
    if baseline not in values:
        raise ValueError(f"baseline {baseline!r} not among the methods {sorted(values)}")
    methods = [baseline] + [m for m in values if m != baseline]
    rows = []
    for method in methods:
        row = OrderedDict(method=method, n=len(values[method]))
        for metric in metrics:
            x = np.array([r[metric] for r in values[method]], dtype=np.float64)
            b = np.array([r[metric] for r in values[baseline]], dtype=np.float64)
            row[f"{metric}_mean"] = float(np.mean(x))
            row[f"{metric}_std"] = float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")
            p = float("nan")
            if method != baseline and len(x) > 1 and len(b) > 1:
                p = float(stats.ttest_ind(x, b, equal_var=False, alternative="greater").pvalue)
            row[f"{metric}_p"] = p
        rows.append(row)
    return rows


def _fmt(x, spec=".2f"):
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def to_markdown(rows, metrics=DEFAULT_METRICS, baseline=None):
    head = ["method", "n"]
    for m in metrics:
        head += [m, f"p ({m} > {baseline})" if baseline else "p"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r["n"])]
        for m in metrics:
            cells += [f"{_fmt(r[f'{m}_mean'])} ± {_fmt(r[f'{m}_std'])}", _fmt(r[f"{m}_p"], ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n", 2)[2])
    ap.add_argument("--run", action="append", default=[], metavar="METHOD=PATH")
    ap.add_argument("--glob", help="glob of metrics files or run dirs (with --regex)")
    ap.add_argument("--regex", help="regex naming the method of each globbed path")
    ap.add_argument("--baseline", required=True, help="method the others are tested against")
    ap.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    ap.add_argument("--out", default="out/summary", help="folder for summary.csv / summary.md")
    args = ap.parse_args(argv)

    runs = collect_runs(args.run, args.glob, args.regex)
    if not runs:
        ap.error("no runs: give --run METHOD=PATH or --glob with --regex")
    values = OrderedDict()
    for method, path in runs:
        values.setdefault(method, []).append(load_metrics(path, args.metrics))
    rows = summarize(values, args.baseline, args.metrics)
    md = to_markdown(rows, args.metrics, args.baseline)
    print(md)

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "summary.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(md + "\n\nmean ± std (ddof=1) over runs; p: one-tailed Welch t-test vs "
                f"{args.baseline}.\n")
    print(f"\nwrote {args.out}/summary.csv and summary.md", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
