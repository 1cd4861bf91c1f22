"""Image-level malignancy classification evaluator (stage 1, MVCCL classifier)."""
import csv
import json
import logging
import math
import os
import warnings
from collections import OrderedDict

import numpy as np
from detectron2.evaluation import DatasetEvaluator
from detectron2.utils import comm
from detectron2.utils.file_io import PathManager
from detectron2.utils.logger import create_small_table

logger = logging.getLogger(__name__)

__all__ = ["ClassificationEvaluator", "classification_metrics"]

_EPS = 1e-7  # probability clip for the BCE, as torch's BCELoss clamps log at -100


def classification_metrics(labels, probs):
    """{"AUC", "BCE", "ACC"} as fractions in [0, 1] (BCE: mean nats). AUC is NaN with a warning
    when only one class is present; ACC thresholds the probability at 0.5."""
    from sklearn.metrics import roc_auc_score

    y = np.asarray(labels, dtype=np.int64)
    p = np.asarray(probs, dtype=np.float64)
    if len(y) == 0:
        nan = float("nan")
        return OrderedDict([("AUC", nan), ("BCE", nan), ("ACC", nan)])
    if len(np.unique(y)) < 2:
        warnings.warn(f"only one class ({int(y[0])}) in the labels; AUC is NaN",
                      RuntimeWarning, stacklevel=2)
        auc = float("nan")
    else:
        auc = float(roc_auc_score(y, p))
    pc = np.clip(p, _EPS, 1 - _EPS)
    bce = float(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc)))
    acc = float(np.mean((p >= 0.5).astype(np.int64) == y))
    return OrderedDict([("AUC", auc), ("BCE", bce), ("ACC", acc)])


class ClassificationEvaluator(DatasetEvaluator):
    """AUC / BCE / accuracy of outputs[i]["prob"] against inputs[i]["label"] (0|1).

    Gathered across ranks (each image once, by image_id); returns {"classification": {...}} on
    the main process ({} elsewhere) with fractions in [0, 1], and writes
    `<output_dir>/classification_predictions.csv` (image_id, label, prob) and
    `classification_metrics.json`. Inputs without a 0/1 label are skipped with a warning.
    """

    def __init__(self, dataset_name, output_dir=None, distributed=True):
        self._dataset_name = dataset_name
        self._output_dir = output_dir
        self._distributed = distributed
        self.reset()

    def reset(self):
        self._predictions = []

    def process(self, inputs, outputs):
        for inp, out in zip(inputs, outputs):
            prob = out["prob"]
            prob = float(prob.detach().cpu().reshape(-1)[0]) if hasattr(prob, "detach") \
                else float(prob)
            self._predictions.append((str(inp["image_id"]), int(inp.get("label", -1)), prob))

    def evaluate(self):
        if self._distributed:
            comm.synchronize()
            parts = comm.gather(self._predictions, dst=0)
            if not comm.is_main_process():
                return {}
            preds = [p for part in parts for p in part]
        else:
            preds = self._predictions
        merged = OrderedDict()
        for image_id, label, prob in preds:
            merged.setdefault(image_id, (label, prob))
        unlabeled = [i for i, (lab, _) in merged.items() if lab not in (0, 1)]
        if unlabeled:
            logger.warning(f"{len(unlabeled)} image(s) without a 0/1 label skipped")
        rows = [(i, lab, p) for i, (lab, p) in merged.items() if lab in (0, 1)]
        if not rows:
            logger.warning(f"[ClassificationEvaluator] no labelled predictions for "
                           f"{self._dataset_name}")
            return {}
        if any(not math.isfinite(p) for _, _, p in rows):
            raise FloatingPointError("non-finite predicted probability")
        res = classification_metrics([r[1] for r in rows], [r[2] for r in rows])
        logger.info(f"Classification on {self._dataset_name} ({len(rows)} images, "
                    f"{sum(r[1] for r in rows)} malignant):\n" + create_small_table(res))
        if self._output_dir:
            PathManager.mkdirs(self._output_dir)
            path = os.path.join(self._output_dir, "classification_predictions.csv")
            with PathManager.open(path, "w") as f:
                w = csv.writer(f)
                w.writerow(["image_id", "label", "prob"])
                for i, lab, p in sorted(rows):
                    w.writerow([i, lab, repr(p)])
            with PathManager.open(os.path.join(self._output_dir,
                                               "classification_metrics.json"), "w") as f:
                json.dump({"dataset": self._dataset_name, "num_images": len(rows),
                           "classification": {k: (v if math.isfinite(v) else None)
                                              for k, v in res.items()}}, f)
        return {"classification": res}
