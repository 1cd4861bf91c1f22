"""Results of pipeline runs: reading what the trainers and tools wrote, tables, seed summaries.

Every number comes from a file a stage wrote (the evaluator's metrics.json, the classifier's
classification_metrics.json, the pseudo-box JSON's "meta"), never from a log line.
"""
import csv
import glob
import io
import json
import math
import os
import re
from collections import OrderedDict

import numpy as np

from ..utils.io import atomic_write_text

OURS = "BRAIxDet"
# the full-label reference row (pipeline/ceiling.py): where the 1/n rows stand, not ranked
CEILING = "Faster R-CNN, full labels (ceiling)"
METRICS = ("AP20", "R@0.5")


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


def load_metrics(path, metrics=METRICS):
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


def summarize(values, baseline, metrics=METRICS):
    """values: {method: [ {metric: x}, ... ]} -> rows (OrderedDicts), baseline first.

    p-values: one-tailed Welch t-test method > baseline (NaN with < 2 runs on either side or
    for the baseline itself).
    """
    if baseline not in values:
        raise ValueError(f"baseline {baseline!r} not among the methods {sorted(values)}")
    from scipy import stats  # here: processes that never summarise skip its 2 s import

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


# paper Table 6 (ADMANI, fully labelled protocol), AP@0.2 (%), by our row labels (methods.py)
PAPER_TABLE6_AP20 = {"Faster R-CNN": 84.52, "Faster R-CNN + MV": 90.05, "SSL (single view)": 89.38,
                     "MV + SSL (Mean Teacher)": 90.51, OURS: 92.78}
# each component's effect as (name, row with it, row without it), both rows of Table 6
COMPONENTS = (("MV", "Faster R-CNN + MV", "Faster R-CNN"),
              ("SSL", "SSL (single view)", "Faster R-CNN"),
              ("MV under SSL", "MV + SSL (Mean Teacher)", "SSL (single view)"),
              ("SSL under MV", "MV + SSL (Mean Teacher)", "Faster R-CNN + MV"),
              ("CAM fusion", OURS, "MV + SSL (Mean Teacher)"))
# each component's effect in the paper, AP@0.2 points: the two rows' difference
PAPER_EFFECTS = {name: PAPER_TABLE6_AP20[with_row] - PAPER_TABLE6_AP20[without_row]
                 for name, with_row, without_row in COMPONENTS}


def paired_effect(x, y, alternative="two-sided", confidence=0.95):
    """The effect x - y paired by seed (x[i], y[i] from the same seed's split and stage 1):
    its mean, the t interval at ``confidence``, the paired t-test's and the Wilcoxon
    signed-rank test's p-values (scipy; NaN where n is too small for them), and the differences'
    standard deviation ``sd`` (what seeds_to_detect reads). A seed undefined on either side
    (NaN or None) cannot be paired: it is left out, and ``n`` counts the seeds paired."""
    from scipy import stats

    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    defined = ~(np.isnan(x) | np.isnan(y))
    x, y = x[defined], y[defined]
    d = x - y
    n, nan = len(d), float("nan")
    out = {"n": n, "mean": float(np.mean(d)) if n else nan, "sd": nan, "ci_low": nan,
           "ci_high": nan, "p_t": nan, "p_wilcoxon": nan}
    if n >= 2:
        out["sd"] = float(np.std(d, ddof=1))
        sem = float(stats.sem(d))
        half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * sem
        out["ci_low"], out["ci_high"] = out["mean"] - half, out["mean"] + half
        if sem > 0:
            out["p_t"] = float(stats.ttest_rel(x, y, alternative=alternative).pvalue)
        if np.any(d != 0):
            out["p_wilcoxon"] = float(stats.wilcoxon(d, alternative=alternative).pvalue)
    return out


def seeds_to_detect(effect, sd, alpha=0.05, power=0.8):
    """Seeds a two-sided paired t-test at ``alpha`` needs to find a true ``effect`` with
    ``power`` when the per-seed differences spread by ``sd`` (statsmodels' TTestPower); NaN
    without a measured spread. How many seeds would decide a component, before paying for them."""
    if not sd > 0 or effect == 0:  # NaN (under two seeds) or no spread: nothing to size
        return float("nan")
    from statsmodels.stats.power import TTestPower

    def enough(n):  # NaN (statsmodels at the smallest n) counts as not enough
        return TTestPower().power(effect_size=abs(effect) / sd, nobs=n, alpha=alpha) >= power

    # power grows with n: double, then bisect (its root finder fails for large effects)
    low, high = 1, 2
    while not enough(high):
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return high


def row_metric(metrics, metric="AP20"):
    """A row's metric from its results entry: the evaluator's {"bbox": {...}} or a flat dict.
    A metric written as null (nan_to_none: undefined, e.g. AP on a split without a lesion)
    reads back as NaN."""
    value = metrics.get("bbox", metrics)[metric]
    return float("nan") if value is None else float(value)


def paired_values(per_seed, a, b, metric="AP20"):
    """(values of row a, of row b) over the seeds that have both (paired_effect leaves out a
    seed whose value is undefined on either side)."""
    pairs = [(s["results"][a], s["results"][b]) for s in per_seed
             if a in s["results"] and b in s["results"]]
    return ([row_metric(x, metric) for x, _ in pairs], [row_metric(y, metric) for _, y in pairs])


def paired_tables(per_seed, metric="AP20"):
    """Markdown of (1) each Table 6 component's effect beside the paper's, (2) BRAIxDet against
    every other row (one-tailed: BRAIxDet greater), both paired by seed; and their dict."""
    def cells(e):
        return (f"{e['n']} | {fmt_effect(e)} | {fmt_cell(e['p_t'], '.4f')} | "
                f"{fmt_cell(e['p_wilcoxon'], '.4f')}")

    lines = [f"| component | with − without | seeds | effect on {metric} (%) [95% CI] | paired t "
             "p (two-sided) | Wilcoxon p | paper Table 6 | same sign | seeds to detect the "
             "paper's effect at this spread (power 0.8) |",
             "|---|---|---|---|---|---|---|---|---|"]
    out = {"components": {}, "ours_vs": {}}
    for name, with_row, without_row in COMPONENTS:
        e = paired_effect(*paired_values(per_seed, with_row, without_row, metric))
        paper = PAPER_EFFECTS[name]
        same = "n/a" if math.isnan(e["mean"]) else ("yes" if e["mean"] * paper > 0 else "no")
        needed = seeds_to_detect(paper, e["sd"])
        out["components"][name] = dict(e, paper=paper, seeds_to_detect_paper=needed)
        lines.append(f"| {name} | {with_row} − {without_row} | {cells(e)} | {paper:+.1f} | "
                     f"{same} | {fmt_cell(needed, 'd')} |")
    rows = list(OrderedDict.fromkeys(k for s in per_seed for k in s["results"]))
    lines += ["", f"| {OURS} − row | seeds | effect on {metric} (%) [95% CI] | paired t p "
              f"(one-tailed, {OURS} greater) | Wilcoxon p (one-tailed) |", "|---|---|---|---|---|"]
    for row in rows:
        if row in (OURS, CEILING):
            continue
        e = paired_effect(*paired_values(per_seed, OURS, row, metric), alternative="greater")
        out["ours_vs"][row] = e
        lines.append(f"| {OURS} − {row} | {cells(e)} |")
    return "\n".join(lines), out


def fmt_cell(x, spec=".2f"):
    """``x`` formatted with ``spec``; "—" for a missing or NaN value."""
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def fmt_effect(e, spec="+.1f"):
    """A paired_effect as "mean [95% CI low, high]"."""
    return (f"{fmt_cell(e['mean'], spec)} "
            f"[{fmt_cell(e['ci_low'], spec)}, {fmt_cell(e['ci_high'], spec)}]")


def seed_table(header, values, seeds):
    """Markdown lines: one line per entry of ``values`` {name: [value per seed]}, its values
    (one decimal; "—" for a NaN one, and then for the mean) under ``seeds`` and their mean;
    ``header`` names the first column."""
    lines = [f"| {header} | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|" + "---|" * (len(seeds) + 1)]
    for name, vals in values.items():
        lines.append(f"| {name} | " + " | ".join(fmt_cell(x, ".1f") for x in vals)
                     + f" | {fmt_cell(float(np.mean(vals)), '.1f')} |")
    return lines


def to_markdown(rows, metrics=METRICS, baseline=None):
    head = ["method", "n"]
    for m in metrics:
        head += [m, f"p ({m} > {baseline})" if baseline else "p"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["method"], str(r["n"])]
        for m in metrics:
            cells += [f"{fmt_cell(r[f'{m}_mean'])} ± {fmt_cell(r[f'{m}_std'])}",
                      fmt_cell(r[f"{m}_p"], ".4f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def read_metrics(folder):
    """The evaluator's metrics.json below ``folder`` (one test set)."""
    for dirpath, _, files in sorted(os.walk(folder)):
        if "metrics.json" in files:
            with open(os.path.join(dirpath, "metrics.json")) as f:
                return json.load(f)
    raise FileNotFoundError(f"no metrics.json under {folder}")


def read_cam_quality(cam_json):
    if not cam_json or not os.path.exists(cam_json):
        return None
    with open(cam_json) as f:
        return json.load(f)["meta"].get("quality")


def _metric(m, key):
    m = m.get("bbox", m)
    v = m.get(key)
    return "n/a" if v is None else f"{float(v):.1f}"


# the screening score's AUC (max detection score per exam; evaluation/exam_scores.py), beside AP
EXAM_AUC = "exam_AUC"


def format_table(results):
    lines = ["| Method | AP@IoU0.2 (%) | Recall@0.5 FPPI (%) | exam AUC (%) |", "|---|---|---|---|"]
    for name, m in results.items():
        lines.append(f"| {name} | {_metric(m, 'AP20')} | {_metric(m, 'R@0.5')} | "
                     f"{_metric({'bbox': m}, EXAM_AUC)} |")
    return "\n".join(lines)


def format_classifiers(classifiers):
    lines = ["| Stage-1 classifier | val AUC | test AUC |", "|---|---|---|"]
    for name, m in classifiers.items():
        auc = [m.get(s, {}).get("AUC") for s in ("val", "test")]
        lines.append(f"| {name} | " + " | ".join(
            "n/a" if v is None else f"{v:.3f}" for v in auc) + " |")
    return "\n".join(lines)


def _mean_std(mean, std, digits=1):
    if mean is None or math.isnan(mean):
        return "n/a"
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if not math.isnan(std) else f"{mean:.{digits}f}"


def _over_seeds(values, digits=1):
    """A table cell of per-seed values: mean ± std (ddof 1), the value alone for one seed."""
    if not values:
        return "n/a"
    std = float(np.std(values, ddof=1)) if len(values) > 1 else float("nan")
    return _mean_std(float(np.mean(values)), std, digits)


def paper_table(per_seed):
    """per_seed: [run_pipeline summary] -> (markdown, summary dict)."""
    values, exam_auc = OrderedDict(), OrderedDict()
    for s in per_seed:
        for label, m in s["results"].items():
            if m.get(EXAM_AUC) is not None:
                exam_auc.setdefault(label, []).append(float(m[EXAM_AUC]))
            m = m.get("bbox", m)
            values.setdefault(label, []).append({k: float(m[k]) for k in METRICS})
    means = {k: float(np.mean([r["AP20"] for r in v])) for k, v in values.items()}
    others = sorted((k for k in values if k not in (OURS, CEILING)), key=lambda k: -means[k])
    second = others[0] if OURS in values and others else None
    rows = summarize(values, second or next(iter(values)), METRICS)
    by_label = {r["method"]: r for r in rows}
    # seeds per row: a record may hold rows of different seed counts
    lines = ["| Method | seeds | AP@IoU0.2 (%) | Recall@0.5 FPPI (%) | exam AUC (%) "
             "| CPU time (min) |", "|---|---|---|---|---|---|"]
    for label in values:
        r = by_label[label]
        # the row's own stage (training + its evaluation; CPU time, not inflated by other jobs),
        # mean over the seeds that timed it
        secs = [s["row_cpu_seconds"][label] for s in per_seed
                if (s.get("row_cpu_seconds") or {}).get(label) is not None]
        time_cell = f"{np.mean(secs) / 60:.1f}" if secs else "n/a"
        lines.append(f"| {label} | {r['n']} | " + " | ".join(
            _mean_std(r[f"{m}_mean"], r[f"{m}_std"]) for m in METRICS)
            + f" | {_over_seeds(exam_auc.get(label))} | {time_cell} |")
    if second is not None:
        p = [by_label[OURS][f"{m}_p"] for m in METRICS]
        # unpaired, as the paper's tables; the paired tests are experiment_table6's tables
        lines.append(f"| {OURS} (p-value vs {second}, one-tailed Welch t-test) | | " + " | ".join(
            "n/a" if math.isnan(x) else f"{x:.4f}" for x in p) + " | | |")

    cls = OrderedDict()
    for s in per_seed:
        for name, m in s.get("classifiers", {}).items():
            for split in ("val", "test"):
                auc = m.get(split, {}).get("AUC")
                cls.setdefault(name, {}).setdefault(split, []).append(
                    float("nan") if auc is None else float(auc))
    lines += ["", "| Stage-1 classifier | val AUC | test AUC | seeds |", "|---|---|---|---|"]
    for name, d in cls.items():
        lines.append(f"| {name} | " + " | ".join(
            _over_seeds(d[s], digits=3) for s in ("val", "test")) + f" | {len(d['val'])} |")
    quality = [s["cam_quality"] for s in per_seed if s.get("cam_quality")]
    if quality:
        lines += ["", "GradCAM pseudo-boxes on D_w (boxes withheld by the protocol): "
                  f"{100 * np.mean([q['box_hit_rate'] for q in quality]):.1f}% of boxes hit a "
                  f"lesion, {100 * np.mean([q['lesion_hit_rate'] for q in quality]):.1f}% of "
                  "lesions hit (IoU >= 0.2; mean over seeds)."]
    summary = {"rows": rows, "second_best": second, "classifiers": cls,
               "seeds": [s["protocol"]["seed"] for s in per_seed]}
    return "\n".join(lines), summary


def write_summary(rows, out, metrics=METRICS, baseline=None):
    """<out>/summary.csv and summary.md of ``summarize`` rows; returns the markdown."""
    md = to_markdown(rows, metrics, baseline)
    os.makedirs(out, exist_ok=True)
    table = io.StringIO(newline="")
    w = csv.DictWriter(table, fieldnames=list(rows[0].keys()))
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(os.path.join(out, "summary.csv"), table.getvalue())
    atomic_write_text(os.path.join(out, "summary.md"), md + "\n\nmean ± std (ddof=1) over runs; "
                      f"p: one-tailed Welch t-test vs {baseline}.\n")
    return md
