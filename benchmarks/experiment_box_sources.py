#!/usr/bin/env python
"""Algorithm 2 fed by three box sources (issue 27 item 3), with the pseudo-label quality over
training (item 5), on development set D.

  python benchmarks/experiment_box_sources.py --out out/dev_d [--stage1 A] [--seed 1]

Three BRAIxDet rows, the same seed, split and stage-1 model: the fusion fed with GradCAM's boxes
(Algorithm 1, the method), with D_w's true cancer boxes (``braixdet_oracle_boxes``: its upper
bound) and with random boxes inside the breast (``braixdet_random_boxes``: a lower bound), each
trained with ``SSL.PSEUDO_QUALITY True``. Where GradCAM's row sits between the two bounds says
whether the loss is in Algorithm 1 (box quality) or in the fusion. The stage-1 model is the one
``experiment_stage1_dev.py`` trained for candidate ``--stage1`` in <out>/<candidate> (reused, not
retrained: same arguments, same done-marker); another ``--seed`` trains its own in
<out>/<candidate>_s<seed> (its own split). Writes <out>/box_sources.md and .json (AP@0.2 and
Recall@0.5 FPPI per row, the mean pseudo-box precision and recall per source over the fusion
phase and after it) and <out>/pseudo_quality_<row>.png. Not part of `make bench` (CPU hours).
"""
import argparse
import os
import re

from experiment_benchmark_regime import make_regime
from experiment_ratio_grid import run_args
from experiment_stage1_dev import CANDIDATES, DEV_SET

from braixdet.pipeline.core import Pipeline
from braixdet.pipeline.methods import METHODS
from braixdet.ssl.pseudo_quality import plot_quality_curves, read_quality_curves
from braixdet.utils.io import atomic_write_json, atomic_write_text

ROWS = ("braixdet", "braixdet_random_boxes", "braixdet_oracle_boxes")
# the trainer's line; logs written before 2026-11-27 say "GradCAM fusion" whatever the source
FUSION_LINE = re.compile(r"Algorithm 2: (?:GradCAM fusion|\w+ boxes fused) during the first "
                         r"(\d+) iterations")


def mean_quality(curves, first, last):
    """{source_metric: mean over the logged points with first <= iteration <= last}."""
    out = {}
    for source, metrics in curves.items():
        for metric, points in metrics.items():
            values = [v for it, v in points if first <= it <= last]
            if values:
                out[f"{source}_{metric}"] = round(sum(values) / len(values), 3)
    return out


def quality_of(run_dir, key, suffix="", data="set D", fusion_end=None):
    """Pseudo-box quality of one row's run: its curves, plotted, and their means in the fusion
    phase (SSL.CAM_FUSION_EPOCHS, as the trainer logged it) and after it. ``data`` names the
    data in the plot's title; ``fusion_end``: split there instead (a row that fuses nothing,
    e.g. Mean Teacher, at another row's phase)."""
    stage = os.path.join(run_dir, key)
    curves = read_quality_curves(os.path.join(stage, "metrics.json"))
    plot_quality_curves(curves, os.path.join(os.path.dirname(run_dir),
                                             f"pseudo_quality_{key}{suffix}.png"),
                        title=f"{METHODS[key].label}: D_w pseudo-boxes vs truth ({data})")
    last = max((it for m in curves.values() for pts in m.values() for it, _ in pts), default=0)
    fusion_end = _fusion_end(stage) if fusion_end is None else fusion_end
    return {"fusion_phase": mean_quality(curves, 0, fusion_end),
            "after": mean_quality(curves, fusion_end + 1, last), "fusion_end": fusion_end}


def _fusion_end(stage):
    """The last iteration of the fusion phase, as the run's trainer logged it."""
    with open(os.path.join(stage, "log.txt")) as f:
        found = FUSION_LINE.findall(f.read())
    if not found:
        raise SystemExit(f"error: {stage}/log.txt: no fusion-phase line")
    return int(found[-1]) - 1


def table(summary):
    lines = ["| row | AP@0.2 | Recall@0.5 FPPI | fused precision / recall (fusion phase) | "
             "cam-source precision / recall | teacher precision / recall (after) |",
             "|---|---|---|---|---|---|"]
    for key in ROWS:
        r = summary["rows"][key]
        q, a = r["quality"]["fusion_phase"], r["quality"]["after"]

        def pr(d, src):
            p, rc = d.get(f"{src}_precision"), d.get(f"{src}_recall")
            return "–" if p is None else f"{p:.2f} / {rc:.2f}"
        box = r["bbox"]
        lines.append(f"| {METHODS[key].label} | {box['AP20']:.1f} | {box['R@0.5']:.1f} | "
                     f"{pr(q, 'fused')} | {pr(q, 'cam')} | {pr(a, 'teacher')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="experiment_stage1_dev.py's --out")
    ap.add_argument("--stage1", default="A", choices=CANDIDATES,
                    help="the stage-1 candidate whose model the rows start from")
    ap.add_argument("--seed", type=int, default=0, help="protocol / training seed")
    ap.add_argument("--det-epochs", type=float, default=3.0, help="stage 2 (the demo's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    a = ap.parse_args(argv)
    a.out = os.path.abspath(a.out)
    a.size, a.stage1_epochs = (256, 128), 5.0  # as experiment_stage1_dev.py's candidates
    a.root, record = make_regime("benchmark_a", dict(DEV_SET), a.out)
    suffix = "" if a.seed == 0 else f"_s{a.seed}"  # seed 0: experiment_stage1_dev's folder
    run_dir = os.path.join(a.out, a.stage1 + suffix)
    # --threads 1 by default: as experiment_stage1_dev.py
    args = run_args(a, "partial", "1/8", a.seed, run_dir, list(ROWS), threads=a.threads)
    args.stage1_opts = [*args.stage1_opts, *CANDIDATES[a.stage1]]
    args.det_opts = [*args.det_opts, "SSL.PSEUDO_QUALITY", "True"]
    summary = Pipeline(args).run_all()
    by_key = {METHODS[k].label: k for k in ROWS}
    rows = {by_key[label]: {**metrics, "quality": quality_of(run_dir, by_key[label], suffix)}
            for label, metrics in summary["results"].items()}
    out = {"dev_set": record, "stage1": a.stage1, "seed": a.seed, "rows": rows,
           "cam_quality": summary["cam_quality"], "classifiers": summary["classifiers"]}
    atomic_write_json(os.path.join(a.out, f"box_sources{suffix}.json"), out, indent=1)
    text = table(out)
    atomic_write_text(os.path.join(a.out, f"box_sources{suffix}.md"), text)
    print(text)


if __name__ == "__main__":
    main()
