"""Pseudo-label quality over training (SSL.PSEUDO_QUALITY): D_w's pseudo-boxes against the truth.

Per source, on the weak cancers whose boxes the protocol withheld (box_sources.true_box_lookup):
``teacher`` (the teacher's pseudo-boxes before fusion), ``cam`` (the boxes Algorithm 2 fuses:
GradCAM, oracle or random, per SSL.CAM_BOX_SOURCE; logged whenever there are some, also after
the fusion phase, as a reference) and ``fused`` (the targets the student trains on). A box is
correct, and a lesion found, at IoU ≥ TEST.BRAIXDET.IOU_THRESH (the evaluation's 0.2).

A batch holds a few images, so each scalar pools the counts of the last ``WINDOW`` iterations
(detectron2's writers record every 20th iteration): ``ssl/quality/<source>_precision`` = correct
boxes / boxes and ``..._recall`` = lesions found / lesions, written only when defined. The truth
is read for these scalars only, never for training. ``read_quality_curves`` and
``plot_quality_curves`` turn a run's metrics.json into the plot.
"""
import collections
import math
import textwrap
from typing import Dict

import torch
from torchvision.ops import box_iou

from ..utils.metrics_log import iter_records

__all__ = ["SOURCES", "WINDOW", "match_counts", "QualityWindow", "read_quality_curves",
           "plot_quality_curves"]

SOURCES = ("teacher", "cam", "fused")
WINDOW = 20  # iterations pooled per scalar
PREFIX = "ssl/quality/"


def match_counts(boxes, truths, iou_thresh=0.2):
    """(correct boxes, boxes, lesions found, lesions) of XYXY ``boxes`` against ``truths``."""
    boxes = torch.as_tensor(boxes, dtype=torch.float32).reshape(-1, 4)
    truths = torch.as_tensor(truths, dtype=torch.float32).reshape(-1, 4).to(boxes.device)
    if len(boxes) == 0 or len(truths) == 0:
        return 0, len(boxes), 0, len(truths)
    hit = box_iou(boxes, truths) >= iou_thresh
    return int(hit.any(1).sum()), len(boxes), int(hit.any(0).sum()), len(truths)


class QualityWindow:
    """Counts per source over the last ``window`` iterations -> pooled precision and recall."""

    def __init__(self, window=WINDOW, iou_thresh=0.2):
        self.iou_thresh = float(iou_thresh)
        self.history = {s: collections.deque(maxlen=window) for s in SOURCES}

    def add(self, boxes_by_source: Dict[str, list], truths: list):
        """One iteration: per source a list of per-image boxes, aligned with ``truths`` (per image
        true boxes, same frame); a source absent this iteration adds nothing."""
        for source, per_image in boxes_by_source.items():
            counts = [match_counts(b, t, self.iou_thresh) for b, t in zip(per_image, truths)]
            self.history[source].append([sum(c[i] for c in counts) for i in range(4)]
                                        if counts else [0, 0, 0, 0])

    def scalars(self) -> Dict[str, float]:
        out = {}
        for source, rows in self.history.items():
            hits, boxes, found, lesions = (sum(r[i] for r in rows) for i in range(4))
            if boxes:
                out[f"{PREFIX}{source}_precision"] = hits / boxes
            if lesions:
                out[f"{PREFIX}{source}_recall"] = found / lesions
        return out


def read_quality_curves(metrics_json) -> Dict[str, Dict[str, list]]:
    """source -> {"precision": [(iteration, value)], "recall": [...]} from a detectron2
    metrics.json (one JSON record per line; a torn last line is ignored)."""
    curves = collections.defaultdict(lambda: {"precision": [], "recall": []})
    for rec in iter_records(metrics_json):
        for key, value in rec.items():
            if not key.startswith(PREFIX) or not isinstance(value, (int, float)) \
                    or math.isnan(value):
                continue
            source, _, metric = key[len(PREFIX):].rpartition("_")
            curves[source][metric].append((int(rec["iteration"]), float(value)))
    return {s: {m: sorted(v) for m, v in c.items()} for s, c in curves.items()}


def plot_quality_curves(curves, out_png, title=""):
    """Precision (solid) and recall (dashed) per source over iterations, as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colours = {"teacher": "tab:blue", "cam": "tab:orange", "fused": "tab:green"}
    for source in sorted(curves, key=lambda s: (s not in SOURCES, s)):
        for metric, style in (("precision", "-"), ("recall", "--")):
            pts = curves[source].get(metric, [])
            if pts:
                ax.plot(*zip(*pts), style, color=colours.get(source), label=f"{source} {metric}")
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"pooled over {WINDOW} iterations")
    ax.set_ylim(0, 1.02)
    # wrapped: a row's label and its data name overflow one line of the figure
    ax.set_title(textwrap.fill(title or "pseudo-boxes of D_w against the truth (IoU >= 0.2)",
                               70), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return out_png
