#!/usr/bin/env python
"""Validation curves of several runs in one picture: a metric at each evaluation, from each
run's metrics.json, with the evaluation the export rule keeps (the best) marked.

  python benchmarks/plot_validation_curves.py "1/8 floor=out/r1_8/s0/faster_rcnn" \\
      "ceiling=out/r1_8/s0/ceiling/faster_rcnn" --out curves.png

Each run is LABEL=PATH (a run folder or its metrics.json). The x axis counts evaluations (one
per epoch under the experiment scripts' schedules), so runs of different lengths line up.
Prints each run's best evaluation. Not part of `make bench` (it needs trained runs).
"""
import argparse
import os

from braixdet.config.schedule import metric_mode
from braixdet.utils.metrics_log import metric_curves


def read_run(path, metric, dataset):
    """[(iteration, value)] of the one key ``<dataset...>/<metric>`` in the run's metrics.json."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.json")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path}: no such file (a run folder holds metrics.json)")
    curves = {k: v for k, v in metric_curves(path, "/" + metric).items()
              if dataset in k.split("/")[0]}
    if len(curves) != 1:
        raise SystemExit(f"error: {path}: expected one '{dataset}' dataset with {metric}, "
                         f"found {sorted(curves) or 'none'}")
    return next(iter(curves.values()))


def best(points, mode):
    """(index, (iteration, value)) of the first best evaluation, as the export rule keeps it."""
    pick = max if mode == "max" else min
    value = pick(v for _, v in points)
    return next((k, p) for k, p in enumerate(points) if p[1] == value)


def plot(runs, out_png, metric, mode, title):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    for label, points in runs:
        x = range(1, len(points) + 1)
        line, = ax.plot(x, [v for _, v in points], "-o", ms=3, label=label)
        k, (_, v) = best(points, mode)
        ax.plot([k + 1], [v], "*", ms=12, color=line.get_color())
    ax.set_xlabel("evaluation (★: the one the export rule keeps)")
    ax.set_ylabel(metric)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", help="LABEL=PATH (a run folder or its metrics.json)")
    ap.add_argument("--metric", default="bbox/AP20", help="the metric's key after the dataset")
    ap.add_argument("--dataset", default="_val", help="text in the validation dataset's name")
    ap.add_argument("--title", default="validation over training")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args(argv)
    mode = metric_mode(args.metric)  # as the export rule compares it (min for a BCE or loss)
    runs = []
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"error: expected LABEL=PATH, got {spec!r}")
        points = read_run(path, args.metric, args.dataset)
        k, (iteration, value) = best(points, mode)
        print(f"{label}: best {args.metric} {value:.4g} at evaluation {k + 1} of {len(points)} "
              f"(iteration {iteration})")
        runs.append((label, points))
    plot(runs, args.out, args.metric, mode, args.title)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
