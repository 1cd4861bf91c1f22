"""Reading a run's detectron2 ``metrics.json`` (JSONWriter: one JSON record per line).

A run killed mid-write leaves a torn last line; readers skip it, so a curve can be drawn from a
run that is still going or was stopped.
"""
import json
import math

__all__ = ["iter_records", "metric_curves"]


def iter_records(metrics_json):
    """The records of ``metrics_json``, in order; torn or non-object lines are skipped."""
    with open(metrics_json) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                yield rec


def metric_curves(metrics_json, suffix):
    """{key: [(iteration, value)]} for every numeric key ending in ``suffix`` (e.g. the
    validation AP ``cbis_ddsm_val_s0/bbox/AP20`` for ``/bbox/AP20``), NaNs left out."""
    curves = {}
    for rec in iter_records(metrics_json):
        for key, value in rec.items():
            if key.endswith(suffix) and isinstance(value, (int, float)) \
                    and not math.isnan(value):
                curves.setdefault(key, []).append((int(rec["iteration"]), float(value)))
    return {k: sorted(v) for k, v in curves.items()}
