#!/usr/bin/env python
"""Can a detector's own scores on the second view help it? Rescoring of saved test detections.

  python benchmarks/experiment_late_fusion.py --runs out/mv_cost/full --rows faster_rcnn \
      --out out/late_fusion

docs/RESULTS.md §26. For each seed folder s<N> under --runs and each row, the detections the
row's exported model left on the test split (inference/model/<test>/detections_coco.json, with
gt_coco.json) are rescored, without training or inference, four ways: ``as saved``; ``late
fusion`` (each box's score × the row's highest score on the image's paired view, 0 where it has
none); ``self`` (× the image's own highest score: the same reshaping without the second view,
the control); ``oracle`` (× 1 where the paired view holds a true lesion, else × 0.01: an
image-level gate that knows what the other view shows). AP@0.2 by braixdet.evaluation.metrics
(pycocotools' rule), each rescoring paired by seed against ``as saved`` and late fusion against
``self``. The paired view is the dataset's own pairing (data/pairing.py ``aux_image_id``).
With ``--bootstrap N`` each seed's effects also get a 95% interval from N resamples of the test
split's exams (RESULTS §27: the test set's sampling noise for one trained model, where there
are too few seeds to pair). With ``--gates mvccl classifier_single_view`` each box's score is
also multiplied by a stage-1 classifier's probability for its image (``gate <name>``, from
<seed>/<name>/inference/model/<test>_cls/classification_predictions.csv; RESULTS §27), and
the gates are compared with ``as saved`` and with each other. With ``--others E5=<folder>``
another detector's saved test detections (its row folder, or an evaluator's output folder
such as experiment_aux_view.py's <row>/inference/aux_main/<test>; ``{seed}`` in the path is
the seed) join as ``row E5`` and are compared the same way, on the same bootstrap draws
(RESULTS §28: two detectors of one seed, paired by test exam). Writes <out>/late_fusion.md
and late_fusion.json. Not part of `make bench`.
"""
import argparse
import csv
import json
import os

import numpy as np
from detectron2.structures import BoxMode

from braixdet.config import build_cfg, resolve_cfg
from braixdet.data.build import get_dicts
from braixdet.evaluation.exam_scores import paired_view_rescore
from braixdet.evaluation.metrics import average_precision
from braixdet.inference.visualize import load_predictions
from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import fmt_cell, fmt_effect, paired_effect, seed_table
from braixdet.utils.io import atomic_write_json, atomic_write_text

TEST = "cbis_ddsm_test"
RESCORINGS = ("as saved", "late fusion", "self", "oracle")
# (with, without) pairs reported, each paired by seed
EFFECTS = (("late fusion", "as saved"), ("late fusion", "self"), ("self", "as saved"),
           ("oracle", "as saved"))
ORACLE_FLOOR = 0.01  # the oracle's factor on an image whose paired view holds no lesion


def load_saved(folder):
    """(gts, dets) of an evaluator's saved COCO files, keyed by the dataset's image id:
    gts {id: (n, 4) xyxy} of every evaluated image, dets {id: ((n, 4) xyxy, (n,) scores)} of
    the images with a detection (read as tools/visualize.py reads them)."""
    with open(os.path.join(folder, "gt_coco.json")) as f:
        gt = json.load(f)
    name = {im["id"]: im["braixdet_image_id"] for im in gt["images"]}
    gts = {i: [] for i in name.values()}
    for a in gt["annotations"]:
        gts[name[a["image_id"]]].append(BoxMode.convert(a["bbox"], BoxMode.XYWH_ABS,
                                                         BoxMode.XYXY_ABS))
    gts = {i: np.asarray(b, dtype=np.float64).reshape(-1, 4) for i, b in gts.items()}
    return gts, load_predictions(os.path.join(folder, "detections_coco.json"))


def effects_of(gates=(), others=()):
    """The (with, without) pairs reported: EFFECTS, each gate and each other row against ``as
    saved``, and the first gate (first other row) against the other gates (rows)."""
    out = list(EFFECTS)
    for names in ([f"gate {g}" for g in gates], [f"row {o}" for o in others]):
        out += [(n, "as saved") for n in names] + [(names[0], n) for n in names[1:]]
    return tuple(out)


def read_gate(run_dir, test=TEST):
    """{image id: probability} of the stage-1 export in ``run_dir`` on the test split."""
    path = os.path.join(run_dir, "inference", "model", f"{test}_cls",
                        "classification_predictions.csv")
    with open(path, newline="") as f:
        return {r["image_id"]: float(r["prob"]) for r in csv.DictReader(f)}


def rescorings(gts, dets, aux_of, gates=None):
    """{rescoring: dets} for RESCORINGS, and ``gate <name>`` for each {name: {image id:
    probability}} of ``gates``; ``aux_of`` {image id: paired view's image id}. Late
    fusion and self are the option TEST.BRAIXDET.PAIRED_VIEW_RESCORE (exam_scores), the
    latter with every image its own partner."""
    scores = {i: dets[i][1] if i in dets else np.zeros(0) for i in gts.keys() | dets.keys()}

    def with_scores(new):
        return {i: (b, new[i]) for i, (b, _) in dets.items()}

    def scaled(factor):  # {image id: factor}
        return {i: (b, s * factor[i]) for i, (b, s) in dets.items()}

    oracle = {i: 1.0 if len(gts.get(aux_of.get(i), ())) else ORACLE_FLOOR for i in dets}
    return {
        "as saved": dets,
        "late fusion": with_scores(paired_view_rescore(scores, aux_of)),
        "self": with_scores(paired_view_rescore(scores, {})),
        "oracle": scaled(oracle),
        **{f"gate {g}": scaled(p) for g, p in (gates or {}).items()},
    }


def test_dicts(run_dir, test=TEST):
    """The test split's dataset dicts, as the row's config registers and pairs them."""
    cfg = resolve_cfg(build_cfg(os.path.join(run_dir, "config.yaml"),
                                ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", ""]))
    del cfg  # building the config registers its datasets
    return get_dicts(test)


def bootstrap_effects(gts, rescored, exam_of, resamples, seed=0, effects=EFFECTS):
    """{"x − y": (2.5th, 97.5th percentile)} of AP@0.2 × 100 differences for ``effects`` over
    ``resamples`` draws of the exams with replacement, every rescoring on the same draws (an
    exam drawn twice counts twice)."""
    exams = sorted(set(exam_of.values()))
    images = {e: [] for e in exams}
    for i in gts:
        images[exam_of[i]].append(i)
    rng = np.random.default_rng(seed)
    diffs = {f"{x} − {y}": [] for x, y in effects}
    for _ in range(resamples):
        drawn = [(k, i) for k, e in enumerate(rng.choice(len(exams), len(exams)))
                 for i in images[exams[e]]]
        g = {key: gts[key[1]] for key in drawn}
        ap = {name: 100 * average_precision(
            g, {key: d[key[1]] for key in drawn if key[1] in d}, iou_thresh=0.2)
              for name, d in rescored.items()}
        for x, y in effects:
            diffs[f"{x} − {y}"].append(ap[x] - ap[y])
    return {k: tuple(float(q) for q in np.percentile(v, [2.5, 97.5])) for k, v in diffs.items()}


def load_other(folder, gts):
    """Saved test detections of another row (its run folder), on exactly ``gts``' images."""
    other_gts, dets = load_saved(folder)
    if other_gts.keys() != gts.keys() or any(
            not np.array_equal(other_gts[i], gts[i]) for i in gts):
        raise SystemExit(f"error: {folder}: its test split is not this row's")
    return dets


def evaluate(run_dir, test=TEST, resamples=0, gates=(), others=None):
    """{rescoring: AP@0.2 × 100} of the row in ``run_dir``, the evaluator's own AP
    ("evaluator", to check the recomputation) and, with ``resamples``, the exam bootstrap's
    intervals ("bootstrap"); ``gates``: stage-1 folder names beside ``run_dir``; ``others``:
    {label: run folder of another row} (``row <label>``)."""
    folder = os.path.join(run_dir, "inference", "model", test)
    gts, dets = load_saved(folder)
    with open(os.path.join(folder, "metrics.json")) as f:
        out = {"evaluator": json.load(f)["bbox"]["AP20"]}
    dicts = test_dicts(run_dir, test)
    rescored = rescorings(gts, dets, {d["image_id"]: d.get("aux_image_id") for d in dicts},
                          {g: read_gate(os.path.join(run_dir, os.pardir, g), test)
                           for g in gates})
    for label, other in (others or {}).items():
        if not os.path.exists(os.path.join(other, "gt_coco.json")):  # a row's run folder
            other = os.path.join(other, "inference", "model", test)
        rescored[f"row {label}"] = load_other(other, gts)
    for k, d in rescored.items():
        out[k] = 100 * average_precision(gts, d, iou_thresh=0.2)
    if resamples:
        out["bootstrap"] = bootstrap_effects(
            gts, rescored, {d["image_id"]: d["exam_id"] for d in dicts}, resamples,
            effects=effects_of(gates, others or {}))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="a folder of seed folders s<N> (run_seeds)")
    ap.add_argument("--rows", nargs="+", default=["faster_rcnn"], choices=sorted(METHODS))
    ap.add_argument("--out", required=True)
    ap.add_argument("--bootstrap", type=int, default=0, metavar="N",
                    help="resamples of the test exams for each seed's intervals (0: none)")
    ap.add_argument("--gates", nargs="+", default=[], metavar="STAGE1",
                    help="stage-1 folders (mvccl, classifier_single_view) whose test "
                         "probabilities gate the boxes, each a rescoring of its own")
    ap.add_argument("--others", nargs="+", default=[], metavar="LABEL=FOLDER",
                    help="other rows' run folders ({seed} = the seed) compared on the same "
                         "test exams, e.g. E5=out/e5/s{seed}/faster_rcnn_mv")
    a = ap.parse_args(argv)
    others = dict(o.split("=", 1) for o in a.others)
    seeds = sorted(int(n[1:]) for n in os.listdir(a.runs) if n[1:].isdigit() and n[0] == "s")
    lines, record = [], {}
    names = (*RESCORINGS, *(f"gate {g}" for g in a.gates), *(f"row {o}" for o in others))
    effect_pairs = effects_of(a.gates, others)
    for row in a.rows:
        aps = {s: evaluate(os.path.join(a.runs, f"s{s}", row), resamples=a.bootstrap,
                           gates=a.gates,
                           others={k: v.format(seed=s) for k, v in others.items()})
               for s in seeds
               if os.path.exists(os.path.join(a.runs, f"s{s}", row, "inference", "model", TEST,
                                              "detections_coco.json"))}
        done = sorted(aps)
        for s in done:
            print(f"   s{s} {row}: " + ", ".join(f"{k} {aps[s][k]:.1f}" for k in names)
                  + f" (evaluator {aps[s]['evaluator']:.1f})", flush=True)
        lines += [f"**{METHODS[row].label}**, seeds {done}, test AP@0.2:", "",
                  *seed_table("rescoring", {k: [aps[s][k] for s in done] for k in names},
                              done)]
        effects = {f"{x} − {y}": paired_effect([aps[s][x] for s in done],
                                               [aps[s][y] for s in done])
                   for x, y in effect_pairs}
        lines += ["", "| effect | mean [95% CI] | paired t p |", "|---|---|---|"]
        for name, e in effects.items():
            lines.append(f"| {name} | {fmt_effect(e)} | {fmt_cell(e['p_t'], '.4f')} |")
        lines.append("")
        if a.bootstrap:
            lines += [f"Per seed, 95% interval over {a.bootstrap} resamples of the test exams:",
                      "", "| effect | " + " | ".join(f"seed {s}" for s in done) + " |",
                      "|---|" + "---|" * len(done)]
            for x, y in effect_pairs:
                cells = []
                for s in done:
                    lo, hi = aps[s]["bootstrap"][f"{x} − {y}"]
                    cells.append(f"{aps[s][x] - aps[s][y]:+.1f} [{lo:+.1f}, {hi:+.1f}]")
                lines.append(f"| {x} − {y} | " + " | ".join(cells) + " |")
            lines.append("")
        record[row] = {"ap": {str(s): aps[s] for s in done}, "effects": effects}
    os.makedirs(a.out, exist_ok=True)
    text = "\n".join(lines)
    atomic_write_text(os.path.join(a.out, "late_fusion.md"), text + "\n")
    atomic_write_json(os.path.join(a.out, "late_fusion.json"), record)
    print(text)


if __name__ == "__main__":
    main()
