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
candidate and the record's rows, results.seed_table) and the effects. Several --record files
pair as one (seeds trained in separate runs); --candidate JSON takes the candidate's per-seed
metrics from an earlier --out instead of training folders, e.g. to pair it with floors trained
later. A seed the record lacks, a record row missing on one of the seeds, or a seed in two
records is refused: a pairing over other seeds or rows than the ones named would not be the one
asked for. Not part of `make bench`.
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


def load_records(paths):
    """The records at ``paths`` as one: seeds trained in separate runs (another --out, another
    session) side by side; a seed held by two of them is refused (which one would be read?)."""
    merged, source = {"settings": None, "seeds": {}}, {}
    for path in paths:
        record = load_record(path)
        merged["settings"] = merged["settings"] or record.get("settings")
        for seed, entry in record["seeds"].items():
            if seed in source:
                raise SystemExit(f"error: --record: seed {seed} is in both {source[seed]} "
                                 f"and {path}")
            source[seed] = path
            merged["seeds"][seed] = entry
    return merged


def load_candidate(path):
    """(name, {seed: metrics}, {seed: folder}) from an earlier output of this script: a
    candidate whose training folders are gone, paired again with other rows."""
    try:
        with open(path) as f:
            earlier = json.load(f)
        name = earlier["name"]
        metrics = {int(s["seed"]): s[name] for s in earlier["seeds"]}
    except OSError as e:
        raise SystemExit(f"error: --candidate {path}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError):
        raise SystemExit(f"error: --candidate {path}: not an output of "
                         "experiment_against_record.py") from None
    return name, dict(sorted(metrics.items())), earlier.get("runs", {})


def pair(record, candidate, against, name):
    """{"seeds": [per seed: the candidate's metrics and the record rows' AP@0.2], "effects":
    {"<name> − <row>": paired_effect}}; ``candidate`` is {seed: its KEPT metrics}. Refuses
    seeds or rows the record lacks."""
    seeds = []
    for seed, metrics in candidate.items():
        entry = record["seeds"].get(str(seed))
        if entry is None:
            raise SystemExit(f"error: the record has no seed {seed} "
                             f"(it has {', '.join(sorted(record['seeds'], key=int))})")
        missing = [row for row in against if row not in entry["results"]]
        if missing:
            raise SystemExit(f"error: the record's seed {seed} has no row {missing[0]!r}")
        seeds.append({"seed": seed, name: metrics,
                      "record": {row: row_metric(entry["results"][row]) for row in against}})
    ours = [row_metric(s[name]) for s in seeds]
    effects = {f"{name} − {row}": paired_effect(ours, [s["record"][row] for s in seeds])
               for row in against}
    return {"seeds": seeds, "effects": effects}


def report(result, name, against):
    """Markdown lines: AP@0.2 per seed (the candidate, then each record row), then each
    effect paired by seed."""
    seeds = [s["seed"] for s in result["seeds"]]
    values = {name: [row_metric(s[name]) for s in result["seeds"]],
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
    ap.add_argument("--record", required=True, nargs="+", action="extend",
                    help="experiment_table6.py's --record JSON, or a run's <out>/table6.json; "
                         "several: their seeds side by side")
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", nargs="+", action="extend", metavar="SEED=FOLDER",
                        help="the candidate's training folder per seed")
    source.add_argument("--candidate", metavar="JSON",
                        help="an earlier --out of this script: its candidate's per-seed "
                             "metrics, paired again (with other rows or another record)")
    ap.add_argument("--against", nargs="+", default=["Faster R-CNN"],
                    help="the record's rows to pair with (their labels)")
    ap.add_argument("--name", help="the candidate's name in the outputs (default: "
                                   "'candidate', or the --candidate file's)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    a = ap.parse_args(argv)
    record = load_records(a.record)
    if a.candidate:
        name, candidate, runs = load_candidate(a.candidate)
        name = a.name or name
    else:
        name, runs = a.name or "candidate", parse_runs(a.run)
        candidate = {seed: candidate_metrics(folder) for seed, folder in runs.items()}
    result = pair(record, candidate, a.against, name)
    result = {"record": [os.path.basename(p) for p in a.record] if len(a.record) > 1
              else os.path.basename(a.record[0]),
              "settings": record.get("settings"), "name": name,
              "runs": {str(k): v for k, v in runs.items()}, **result}
    atomic_write_json(a.out, nan_to_none(result), indent=1)
    print("\n".join(report(result, name, a.against)))


if __name__ == "__main__":
    main()
