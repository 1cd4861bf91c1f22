#!/usr/bin/env python
"""Pseudo-label quality over training: precision and recall of D_w's pseudo-boxes per source
(teacher, CAM source, fused) from the metrics.json of stage-2 runs trained with
SSL.PSEUDO_QUALITY True (braixdet/ssl/pseudo_quality.py).

  python benchmarks/plot_pseudo_quality.py out/run/braixdet/metrics.json --out quality.png

Several metrics.json files give one PNG each (``<out stem>_<k>.png``), titled by their run
folder. Not part of `make bench` (it needs trained runs).
"""
import argparse
import os

from braixdet.ssl.pseudo_quality import plot_quality_curves, read_quality_curves


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics", nargs="+", help="metrics.json of stage-2 runs")
    ap.add_argument("--out", required=True, help="PNG path")
    args = ap.parse_args()
    stem, ext = os.path.splitext(args.out)
    for k, path in enumerate(args.metrics):
        curves = read_quality_curves(path)
        if not curves:
            print(f"{path}: no ssl/quality/* scalars (train with SSL.PSEUDO_QUALITY True)")
            continue
        out = args.out if len(args.metrics) == 1 else f"{stem}_{k}{ext or '.png'}"
        title = os.path.basename(os.path.dirname(os.path.abspath(path)))
        plot_quality_curves(curves, out, title=f"{title}: D_w pseudo-boxes vs truth")
        print(f"{path} -> {out}")


if __name__ == "__main__":
    main()
