#!/usr/bin/env python
"""Can Algorithm 2's fusion put BRAIxDet ahead of Mean Teacher, and if not, where is the loss?

  python benchmarks/experiment_fusion_bounds.py --out out/fusion_bounds --seeds 0 1 2 3 4
  python benchmarks/experiment_fusion_bounds.py --out out/few_boxes --ratio 1/32 \
      --rows mean_teacher braixdet braixdet_oracle_boxes braixdet_oracle_boxes_whole_schedule

Issue 27 items 2 and 3, docs/RESULTS.md §16 (criteria written before the runs). Development
set F: the demo's generator call with benchmark_a's anatomy and look-alikes (RESULTS §1.8's
candidate H1: room between the 1/8 floor and the ceiling, a stage 1 that learns), drawn with
generator seed 11 (the demo's data: 0; §1.8's draw: 1; set E: 7). Per seed one pipeline run of
DEFAULT_ROWS sharing the seed's split and stage 1, with SSL.PSEUDO_QUALITY on: Mean Teacher,
BRAIxDet, and BRAIxDet with Algorithm 2 fed by random boxes inside the breast, by D_w's true
cancer boxes in the paper's window, and by the true boxes at every iteration; --ceiling adds the
full-label ceiling of each seed's split, and each row's effect against it (context: how much
room the rows have). --ratio runs the same at fewer boxes (RESULTS §17: where Mean Teacher has
room under the ceiling); --rows a subset or the diagnostic row braixdet_whole_schedule (§17 step
3; the verdict needs Mean Teacher, BRAIxDet and the two oracle rows). Writes
<out>/fusion_bounds.md and .json (rows per seed, effects paired by seed, the verdict, the
pseudo-box quality per source), <out>/fusion_bounds.png (the rows per seed against the ceiling) and
<out>/pseudo_quality_<row>_s<seed>.png. Re-running continues (done-markers); seeds can run
as separate processes and a last run over all of them writes the table. Not part of
`make bench` (about 30 CPU minutes a seed).
"""
import argparse
import os
import time

from _common import plot_rows
from experiment_box_sources import quality_of
from experiment_demo_data import CANDIDATES
from experiment_mv_cost import effects_of, effects_table, row_table

from braixdet.pipeline.ceiling import add_ceiling
from braixdet.pipeline.demo import DEMO, make_data, pipeline_args
from braixdet.pipeline.methods import METHODS
from braixdet.pipeline.results import (
    CEILING,
    PAPER_EFFECTS,
    fmt_cell,
    paired_effect,
    paired_values,
    seeds_to_detect,
)
from braixdet.pipeline.seeds import run_seeds, seed_args
from braixdet.utils.io import atomic_write_json, atomic_write_text

DATA_SEED = 11
SPEC = dict(DEMO["full"], generator=CANDIDATES["H1"])
ROWS = ["mean_teacher", "braixdet", "braixdet_random_boxes", "braixdet_oracle_boxes",
        "braixdet_oracle_boxes_whole_schedule", "braixdet_whole_schedule"]
DEFAULT_ROWS = ROWS[:5]  # RESULTS §16's rows; the last (§17 step 3, a diagnostic) when named
FUSION = "CAM fusion (BRAIxDet − Mean Teacher)"
ORACLE = "oracle boxes, paper's window − Mean Teacher"
ORACLE_WHOLE = "oracle boxes, whole schedule − Mean Teacher"
GRADCAM_WHOLE = "GradCAM boxes, whole schedule − Mean Teacher"
EFFECTS = {
    FUSION: (("braixdet",), ("mean_teacher",)),
    ORACLE: (("braixdet_oracle_boxes",), ("mean_teacher",)),
    ORACLE_WHOLE: (("braixdet_oracle_boxes_whole_schedule",), ("mean_teacher",)),
    "GradCAM − random boxes": (("braixdet",), ("braixdet_random_boxes",)),
    "oracle − GradCAM boxes, paper's window": (("braixdet_oracle_boxes",), ("braixdet",)),
    # RESULTS §17 step 3, a diagnostic (not a criterion): Algorithm 1's boxes fused throughout
    GRADCAM_WHOLE: (("braixdet_whole_schedule",), ("mean_teacher",)),
}


def effects_between(rows):
    """The EFFECTS whose rows are all among ``rows``."""
    return {name: sides for name, sides in EFFECTS.items()
            if set(sides[0] + sides[1]) <= set(rows)}


def verdict(effects):
    """RESULTS §16's criteria, in order: BRAIxDet ahead when its effect over Mean Teacher has a
    95% interval above 0; else the loss is in Algorithm 1's boxes when true boxes in the paper's
    window are ahead; else in Algorithm 2's window when true boxes at every iteration are;
    else the fusion has nothing measurable to add on this data. Under two seeds: undecided."""
    def above(name):
        return effects[name]["ci_low"] > 0

    if any(name not in effects for name in (FUSION, ORACLE, ORACLE_WHOLE)):
        return "undecided: not every row of the criteria was run"
    if effects[FUSION]["n"] < 2:
        return "undecided: fewer than two seeds with every row"
    if above(FUSION):
        return "BRAIxDet ahead of Mean Teacher"
    if above(ORACLE):
        return "the loss is in Algorithm 1's boxes (true boxes in the paper's window are ahead)"
    if above(ORACLE_WHOLE):
        return ("the loss is in Algorithm 2's window (true boxes are ahead only when fused at "
                "every iteration)")
    return ("the fusion adds nothing measurable here: even true boxes at every iteration are "
            "not ahead of Mean Teacher")


def seeds_for_paper(effects):
    """A line: the seeds a paired t-test needs to find the paper's CAM fusion effect (Table 6)
    at the spread BRAIxDet − Mean Teacher had here; None without that effect."""
    e = effects.get(FUSION)
    if e is None or not e["n"] >= 2:
        return None
    paper = PAPER_EFFECTS["CAM fusion"]
    return (f"Seeds a paired t-test (two-sided, 0.05) needs to find the paper's CAM fusion effect "
            f"({paper:+.1f} AP, Table 6) with power 0.8 at this spread of {FUSION} (sd "
            f"{e['sd']:.1f} AP over {e['n']} seeds): "
            f"{fmt_cell(seeds_to_detect(paper, e['sd']), 'd')}.")


def ceiling_effects(per_seed, rows):
    """{"<row> − ceiling": results.paired_effect} for each of ``rows`` the ceiling ran beside:
    the room a row leaves under full labels (context for the verdict, not one of its criteria)."""
    effects = {}
    for key in rows:
        x, y = paired_values(per_seed, METHODS[key].label, CEILING)
        if x:
            effects[f"{METHODS[key].label} − ceiling"] = dict(
                paired_effect(x, y), rows=[[key], [CEILING]])
    return effects


def pseudo_quality(out, seeds, rows=DEFAULT_ROWS, ratio="1/8"):
    """{row: {seed: quality_of(...)}} over the seeds that ran the row; Mean Teacher's split at
    BRAIxDet's fusion phase of the same seed (its teacher without any fused box, for comparison)."""
    quality = {}
    for key in sorted(rows, key=lambda k: k == "mean_teacher"):  # BRAIxDet's phase first
        for seed in seeds:
            run_dir = os.path.join(out, f"s{seed}")
            if not os.path.exists(os.path.join(run_dir, key, "metrics.json")):
                continue
            end = None
            if key == "mean_teacher":
                end = quality.get("braixdet", {}).get(seed, {}).get("fusion_end")
                if end is None:
                    continue
            quality.setdefault(key, {})[seed] = quality_of(
                run_dir, key, f"_s{seed}", data=f"set F at {ratio}, seed {seed}", fusion_end=end)
    return quality


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--ratio", default="1/8", help="the partial protocol's label ratio")
    ap.add_argument("--rows", nargs="+", choices=ROWS, default=DEFAULT_ROWS,
                    help=f"default: {' '.join(DEFAULT_ROWS)}")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    ap.add_argument("--ceiling", action="store_true",
                    help="also the full-label ceiling per seed (pipeline/ceiling.py; context for "
                         "the rows, not read by the verdict)")
    a = ap.parse_args(argv)
    rows = [k for k in ROWS if k in a.rows]
    out, t0 = os.path.abspath(a.out), time.time()
    root = os.path.join(out, "data")
    make_data(root, SPEC, seed=DATA_SEED)
    args = pipeline_args(root, out, SPEC, out, 0, rows)
    args.ratio = a.ratio
    args.opts = [*args.opts, "NUM_THREADS", str(a.threads)]
    args.det_opts = [*args.det_opts, "SSL.PSEUDO_QUALITY", "True"]
    per_seed = run_seeds(args, a.seeds, out)
    labels = [METHODS[k].label for k in rows]
    if a.ceiling:
        for seed, summary in zip(a.seeds, per_seed):
            add_ceiling(seed_args(args, seed, out), summary, SPEC["ceiling_epochs"])
        labels.append(CEILING)
    effects = effects_of(per_seed, effects_between(rows), rows)
    context = ceiling_effects(per_seed, rows)
    answer, power = verdict(effects), seeds_for_paper(effects)
    text = "\n".join([
        f"Development set F (generator seed {DATA_SEED}), ratio {a.ratio}; seeds {a.seeds}; "
        "AP@IoU0.2 (%) on the test split.", "", *row_table(per_seed, a.seeds, labels), "",
        *([*effects_table(effects), ""] if effects else []),
        *([power, ""] if power else []),
        *(["Context, not a criterion: each row against the full-label ceiling.", "",
           *effects_table(context), ""] if context else []),
        f"Verdict (RESULTS §16's criteria): **{answer}**.", "",
        f"{(time.time() - t0) / 60:.1f} min."]) + "\n"
    atomic_write_text(os.path.join(out, "fusion_bounds.md"), text)
    plot_rows(per_seed, a.seeds, os.path.join(out, "fusion_bounds.png"), rows)
    atomic_write_json(os.path.join(out, "fusion_bounds.json"), {
        "data_seed": DATA_SEED, "spec": SPEC, "ratio": a.ratio, "seeds": a.seeds, "rows": rows,
        "effects": effects, "ceiling_effects": context, "verdict": answer,
        "seeds_for_paper": power,
        "per_seed": [s["results"] for s in per_seed],
        "cam_quality": [s.get("cam_quality") for s in per_seed],
        "classifiers": [s.get("classifiers") for s in per_seed],
        "pseudo_quality": pseudo_quality(out, a.seeds, rows, a.ratio)}, indent=1)
    print("\n" + text)


if __name__ == "__main__":
    main()
