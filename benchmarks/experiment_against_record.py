#!/usr/bin/env python
"""A detector trained outside a Table 6 record, paired by seed with the record's rows.

  python benchmarks/experiment_against_record.py \
      --record docs/results/table6_benchmark_a_1300_256.json --name IA \
      --run 0=out/ia/s0/faster_rcnn_mv --run 1=out/ia/r1_8/s1/faster_rcnn_mv \
      --against "Faster R-CNN" "Faster R-CNN + MV" --out out/ia_against_record.json

docs/RESULTS.md §33. A candidate (an option under test, e.g.
MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT) is trained per seed on the record's data and split, in
whatever run it took (``--run SEED=FOLDER``, repeatable: the row's training folder, whose
exported model's test evaluation inference/model/<test>/metrics.json is read); each seed's test
AP@0.2 is paired with the record's rows of the same seed (experiment_table6.py --record's JSON,
or a run's <out>/table6.json), as results.paired_effect: mean, 95% t interval, paired t and
Wilcoxon p. Writes --out (JSON; NaN as null) and prints the per-seed table (rows: the
candidate and the record's rows, results.seed_table) and the effects. A
seed the record lacks, or a record row missing on one of the seeds, is refused: a pairing over
other seeds than the ones named would not be the one asked for. Not part of `make bench`.
"""
import argparse
import json
import os

from braixdet.pipeline.results import (
    fmt_cell,
    fmt_effect,
    paired_effect,
    read_metrics,
    row_metric,
    seed_table,
)
from braixdet.utils.io import atomic_write_json, nan_to_none

# the candidate's metrics kept per seed (the evaluator's names), beside AP@0.2
KEPT = ("AP20", "R@0.5", "breast_AUC")


def parse_runs(items):
    """``SEED=FOLDER`` items -> {seed: folder}, sorted by seed."""
    runs = {}
    for item in items:
        seed, sep, folder = item.partition("=")
        if not sep or not seed.strip().isdigit() or not folder:
            raise SystemExit(f"error: --run {item!r}: expected SEED=FOLDER, e.g. 0=out/s0/row")
        if int(seed) in runs:
            raise SystemExit(f"error: --run: seed {seed} given twice")
        runs[int(seed)] = folder
    return dict(sorted(runs.items()))


def candidate_metrics(folder):
    """The KEPT metrics of the test evaluation of the model ``folder`` exported (its training
    metrics.json, detectron2's event log, sits above it)."""
    try:
        m = read_metrics(os.path.join(folder, "inference", "model"))
    except FileNotFoundError:
        raise SystemExit(f"error: {folder}: no test evaluation of its exported model "
                         "(inference/model/<test>/metrics.json); has the row finished?") from None
    flat = {**m, **m.get("bbox", {})}
    if flat.get("AP20") is None:  # null: a test split without lesions
        raise SystemExit(f"error: {folder}: its test evaluation has no AP@0.2")
    return {k: float(flat[k]) for k in KEPT if flat.get(k) is not None}


def load_record(path):
    """experiment_table6.py's record at ``path`` (its --record, or a run's table6.json); a
    missing or foreign file is a one-line error."""
    try:
        with open(path) as f:
            record = json.load(f)
    except OSError as e:
        raise SystemExit(f"error: --record {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise SystemExit(f"error: --record {path}: not JSON ({e})") from None
    if isinstance(record, dict) and isinstance(record.get("per_seed"), list):
        # a run's <out>/table6.json: its seeds and their rows side by side, as a record holds them
        return {"settings": record.get("regime"),
                "seeds": {str(seed): {"results": results}
                          for seed, results in zip(record["seeds"], record["per_seed"])}}
    if not isinstance(record, dict) or not isinstance(record.get("seeds"), dict):
        raise SystemExit(f"error: --record {path}: not a record of experiment_table6.py "
                         "(no 'seeds')")
    return record


def pair(record, runs, against, name):
    """{"seeds": [per seed: the candidate's metrics and the record rows' AP@0.2], "effects":
    {"<name> − <row>": paired_effect}}; refuses seeds or rows the record lacks."""
    seeds = []
    for seed, folder in runs.items():
        entry = record["seeds"].get(str(seed))
        if entry is None:
            raise SystemExit(f"error: the record has no seed {seed} "
                             f"(it has {', '.join(sorted(record['seeds'], key=int))})")
        missing = [row for row in against if row not in entry["results"]]
        if missing:
            raise SystemExit(f"error: the record's seed {seed} has no row {missing[0]!r}")
        seeds.append({"seed": seed, name: candidate_metrics(folder),
                      "record": {row: row_metric(entry["results"][row]) for row in against}})
    ours = [s[name]["AP20"] for s in seeds]
    effects = {f"{name} − {row}": paired_effect(ours, [s["record"][row] for s in seeds])
               for row in against}
    return {"seeds": seeds, "effects": effects}


def report(result, name, against):
    """Markdown lines: AP@0.2 per seed (the candidate, then each record row), then each
    effect paired by seed."""
    seeds = [s["seed"] for s in result["seeds"]]
    values = {name: [s[name]["AP20"] for s in result["seeds"]],
              **{row: [s["record"][row] for s in result["seeds"]] for row in against}}
    lines = [*seed_table("AP@0.2", values, seeds),
             "", "| effect | seeds | mean [95% CI] | paired t p | Wilcoxon p |",
             "|---|---|---|---|---|"]
    for k, e in result["effects"].items():
        lines.append(f"| {k} | {e['n']} | {fmt_effect(e)} | {fmt_cell(e['p_t'], '.4f')} | "
                     f"{fmt_cell(e['p_wilcoxon'], '.4f')} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", required=True,
                    help="experiment_table6.py's --record JSON, or a run's <out>/table6.json")
    ap.add_argument("--run", nargs="+", action="extend", required=True, metavar="SEED=FOLDER",
                    help="the candidate's training folder per seed")
    ap.add_argument("--against", nargs="+", default=["Faster R-CNN"],
                    help="the record's rows to pair with (their labels)")
    ap.add_argument("--name", default="candidate", help="the candidate's name in the outputs")
    ap.add_argument("--out", required=True, help="JSON file to write")
    a = ap.parse_args(argv)
    record = load_record(a.record)
    runs = parse_runs(a.run)
    result = pair(record, runs, a.against, a.name)
    result = {"record": os.path.basename(a.record), "settings": record.get("settings"),
              "name": a.name, "runs": {str(k): v for k, v in runs.items()},
              **result}
    atomic_write_json(a.out, nan_to_none(result), indent=1)
    print("\n".join(report(result, a.name, a.against)))


if __name__ == "__main__":
    main()
