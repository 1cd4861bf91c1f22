"""Lesion-detection evaluator: AP at IoU 0.2 and FROC recall (docs/DESIGN.md §5, paper §4.2)."""
import csv
import json
import logging
import os
from collections import OrderedDict

import numpy as np
from detectron2.data import DatasetCatalog, MetadataCatalog
from detectron2.evaluation import DatasetEvaluator
from detectron2.structures import BoxMode
from detectron2.utils import comm
from detectron2.utils.file_io import PathManager
from detectron2.utils.logger import create_small_table

from ..utils.io import nan_to_none
from .classification_evaluator import ClassificationEvaluator
from .exam_scores import breast_exam_auc, image_score, paired_view_rescore
from .metrics import average_precision, froc

logger = logging.getLogger(__name__)

__all__ = ["MammoDetectionEvaluator", "build_evaluator", "fppi_key", "ap_key"]


def ap_key(iou_thresh):
    return f"AP{int(round(iou_thresh * 100))}"


def fppi_key(x):
    return f"R@{float(x):g}"


def _gt_boxes(record):
    """(N, 4) XYXY_ABS GT boxes of a dataset dict; dicts without "annotations" have none."""
    boxes = [BoxMode.convert(list(a["bbox"]), a.get("bbox_mode", BoxMode.XYXY_ABS),
                             BoxMode.XYXY_ABS) for a in record.get("annotations", [])]
    return np.asarray(boxes, dtype=np.float64).reshape(-1, 4)


def _fix_inverted(boxes, what, image_id):
    """Inverted boxes become degenerate (x1 = x0): an FP if predicted, a missed lesion if GT."""
    bad = (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    if bad.any():
        logger.warning(f"{bad.sum()} inverted {what} box(es) in image {image_id}; "
                       "counted as zero-area boxes")
        boxes = boxes.copy()
        boxes[:, 2] = np.maximum(boxes[:, 2], boxes[:, 0])
        boxes[:, 3] = np.maximum(boxes[:, 3], boxes[:, 1])
    return boxes


class MammoDetectionEvaluator(DatasetEvaluator):
    """AP at one IoU threshold (COCO 101-point, one class) and FROC recall at given FPPI.

    GT: `DatasetCatalog.get(dataset_name)` dicts' "annotations" (XYXY_ABS, original pixels);
    dicts without annotations are lesion-free images. The evaluated images are the ones given to
    `process` (as detectron2's COCOEvaluator); each counts in the FPPI denominator.
    Predictions: outputs[i]["instances"].pred_boxes in ORIGINAL pixels, .scores.

    `evaluate()` returns, on the main process, {"bbox": {"AP20": .., "R@0.25": .., "R@0.5": ..,
    "R@1": .., "R@2": .., "R@4": ..}, "screening": {"breast_AUC": .., "exam_AUC": ..}} with AP,
    recalls and AUCs in PERCENT (like detectron2's COCO evaluator); the AUCs score breasts and
    exams (dicts' ``exam_id``/``laterality``/``label``) by the max detection score
    (``evaluation/exam_scores.py``, the scores of predictions.json), NaN with one class. AP uses
    the top `max_dets` detections per image (COCO's maxDets), FROC all of
    them. Other ranks return {}. With `output_dir`, the main process writes metrics.json,
    froc.csv, froc.png, detections_coco.json and gt_coco.json (COCO formats, category_id 1,
    image ids 1..N in sorted image_id order; "file_name" holds the dataset's image_id, never a
    path, so no patient folder name leaks).
    ``paired_view_rescore``: every score is first multiplied by the top score of the image's
    paired view (dicts' ``aux_image_id``; ``exam_scores.paired_view_rescore``), and every
    metric and file holds the rescored scores.
    """

    def __init__(self, dataset_name, output_dir=None, iou_thresh=0.2,
                 fppi=(0.25, 0.5, 1, 2, 4), center_hit=False, distributed=True, max_dets=100,
                 save_plots=True, paired_view_rescore=False):
        self._dataset_name = dataset_name
        self._output_dir = output_dir
        self._iou_thresh = float(iou_thresh)
        self._fppi = tuple(float(x) for x in fppi)
        self._center_hit = bool(center_hit)
        self._distributed = distributed
        self._max_dets = max_dets
        self._save_plots = save_plots
        self._paired_view_rescore = bool(paired_view_rescore)
        self._records = None
        self.reset()

    @classmethod
    def from_config(cls, cfg, dataset_name, output_dir=None, distributed=True):
        t = cfg.TEST.BRAIXDET
        return cls(dataset_name, output_dir=output_dir, iou_thresh=t.IOU_THRESH,
                   fppi=tuple(t.FROC_FPPI), center_hit=t.CENTER_HIT, distributed=distributed,
                   save_plots=t.get("SAVE_PLOTS", True),
                   paired_view_rescore=t.get("PAIRED_VIEW_RESCORE", False))

    def reset(self):
        self._predictions = []

    def _dataset(self):
        if self._records is None:
            self._records = {str(d["image_id"]): d for d in DatasetCatalog.get(self._dataset_name)}
        return self._records

    def process(self, inputs, outputs):
        for inp, out in zip(inputs, outputs):
            inst = out["instances"].to("cpu")
            boxes = inst.pred_boxes.tensor.numpy().astype(np.float64).reshape(-1, 4)
            scores = inst.scores.numpy().astype(np.float64).reshape(-1)
            self._predictions.append({"image_id": str(inp["image_id"]), "boxes": boxes,
                                      "scores": scores})

    def _gathered(self):
        if self._distributed:
            comm.synchronize()
            parts = comm.gather(self._predictions, dst=0)
            if not comm.is_main_process():
                return None
            preds = [p for part in parts for p in part]
        else:
            preds = self._predictions
        merged = OrderedDict()
        for p in preds:
            if p["image_id"] in merged:  # e.g. a sampler padding the last batch
                logger.warning(f"image {p['image_id']} processed twice; keeping the first")
                continue
            merged[p["image_id"]] = p
        return merged

    def evaluate(self):
        preds = self._gathered()
        if preds is None:
            return {}
        if len(preds) == 0:
            logger.warning(f"[MammoDetectionEvaluator] no predictions for {self._dataset_name}")
            return {}
        records = self._dataset()
        unknown = [i for i in preds if i not in records]
        if unknown:
            raise KeyError(f"{len(unknown)} processed image_id(s) not in dataset "
                           f"{self._dataset_name!r}, e.g. {unknown[0]!r}")
        if len(preds) < len(records):
            logger.warning(f"{len(records) - len(preds)} of {len(records)} images of "
                           f"{self._dataset_name} were not processed; evaluating the rest")

        ids = sorted(preds)
        gts = {i: _fix_inverted(_gt_boxes(records[i]), "GT", i) for i in ids}
        scores = {i: preds[i]["scores"] for i in ids}
        if self._paired_view_rescore:
            scores = paired_view_rescore(
                scores, {i: str(records[i].get("aux_image_id", i)) for i in ids})
        dets = {i: (_fix_inverted(preds[i]["boxes"], "predicted", i), scores[i]) for i in ids}
        results, curve = self.compute(gts, dets)
        screening = self.screening(records, dets)
        self._log(results, gts, dets)
        logger.info("breast/exam malignancy score (max detection score) AUC in %:\n"
                    + create_small_table(screening))
        if self._output_dir and comm.is_main_process():
            self._save(results, curve, gts, dets, records, screening)
        return {"bbox": results, "screening": screening}

    @staticmethod
    def screening(records, dets):
        """Breast- and exam-level AUC (percent) of the max-detection-score malignancy score, and
        its image-level BCE against the image labels (nats, not percent): the detector's
        analogue of stage 1's validation BCE (SOLVER.BRAIXDET.PLATEAU_METRIC
        "screening/image_BCE"; paper §4.3)."""
        from sklearn.metrics import log_loss  # here: non-evaluating processes skip 2 s

        scores = {i: image_score(s) for i, (_, s) in dets.items()}
        breast, exam, _, _ = breast_exam_auc(records, scores)
        ids = sorted(scores)
        bce = log_loss([int(records[i]["label"]) for i in ids],
                       np.clip([scores[i] for i in ids], 1e-7, 1 - 1e-7), labels=[0, 1])
        return OrderedDict([("breast_AUC", 100.0 * breast), ("exam_AUC", 100.0 * exam),
                            ("image_BCE", float(bce))])

    def compute(self, gts, dets):
        """Metrics (percent) and the FROC curve dict for numpy GT / detections dicts."""
        ap = average_precision(gts, dets, iou_thresh=self._iou_thresh, max_dets=self._max_dets)
        curve = froc(gts, dets, iou_thresh=self._iou_thresh, center_hit=self._center_hit,
                     fppi_points=self._fppi)
        results = OrderedDict([(ap_key(self._iou_thresh), 100.0 * ap)])
        for x in self._fppi:
            results[fppi_key(x)] = 100.0 * curve["recall_at_fppi"][x]
        return results, curve

    def _log(self, results, gts, dets):
        n_gt = sum(len(b) for b in gts.values())
        n_pos = sum(len(b) > 0 for b in gts.values())
        n_det = sum(len(s) for _, s in dets.values())
        logger.info(f"Evaluation of {self._dataset_name}: {len(gts)} images ({n_pos} with "
                    f"lesions, {n_gt} lesions), {n_det} detections, IoU >= "
                    f"{self._iou_thresh:g}{', centre hit' if self._center_hit else ''} "
                    "(AP and recall in %):\n" + create_small_table(results))

    # ---- files -------------------------------------------------------------------------------
    def _save(self, results, curve, gts, dets, records, screening):
        PathManager.mkdirs(self._output_dir)
        coco_id = {i: k + 1 for k, i in enumerate(sorted(gts))}
        meta = {
            "dataset": self._dataset_name,
            # DATASETS.BRAIXDET.TEST_IMAGES of a registered test set (paper | full | ...)
            "test_images": MetadataCatalog.get(self._dataset_name).get("test_images", None),
            "bbox": dict(results),
            **screening,
            "units": "percent",
            "iou_thresh": self._iou_thresh,
            "center_hit": self._center_hit,
            "max_dets": self._max_dets,
            "paired_view_rescore": self._paired_view_rescore,
            "fppi": list(self._fppi),
            "num_images": curve["num_images"],
            "num_lesions": curve["num_lesions"],
            "num_detections": curve["num_detections"],
        }
        self._write_json("metrics.json", nan_to_none(meta))

        with PathManager.open(os.path.join(self._output_dir, "froc.csv"), "w") as f:
            w = csv.writer(f)
            w.writerow(["threshold", "fppi", "sensitivity", "tp", "fp"])
            for row in zip(curve["thresholds"], curve["fppi"], curve["sensitivity"],
                           curve["tp"], curve["fp"]):
                w.writerow([repr(float(row[0])), repr(float(row[1])), repr(float(row[2])),
                            int(row[3]), int(row[4])])
        if self._save_plots:
            try:
                plot_froc(curve, os.path.join(self._output_dir, "froc.png"),
                          title=f"FROC {self._dataset_name}", mark=0.5)
            except Exception as e:  # a plot must never fail an evaluation
                logger.warning(f"could not plot the FROC curve: {e}")

        images, anns = [], []
        for i in sorted(gts):
            r = records[i]
            images.append({"id": coco_id[i], "file_name": i, "braixdet_image_id": i,
                           "height": int(r.get("height", 0)), "width": int(r.get("width", 0))})
            for b in gts[i]:
                xywh = [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]
                anns.append({"id": len(anns) + 1, "image_id": coco_id[i], "category_id": 1,
                             "bbox": xywh, "area": xywh[2] * xywh[3], "iscrowd": 0})
        self._write_json("gt_coco.json", {
            "info": {"description": f"BRAIxDet GT of {self._dataset_name}"},
            "images": images, "annotations": anns,
            "categories": [{"id": 1, "name": "malignant"}]})
        res = []
        for i in sorted(dets):
            boxes, scores = dets[i]
            for b, s in zip(boxes, scores):
                res.append({"image_id": coco_id[i], "category_id": 1,
                            "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]),
                                     float(b[3] - b[1])],
                            "score": float(s), "braixdet_image_id": i})
        self._write_json("detections_coco.json", res)

    def _write_json(self, name, obj):
        path = os.path.join(self._output_dir, name)
        with PathManager.open(path, "w") as f:
            json.dump(obj, f)
        logger.info(f"wrote {path}")


def plot_froc(curve, out_png, title="FROC", mark=0.5):
    """Sensitivity vs FPPI on a log-x axis, with a marker at FPPI = `mark`."""
    # Figure + Agg canvas directly: no pyplot, so no global backend switch and no GUI
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fppi = np.asarray(curve["fppi"])
    sens = np.asarray(curve["sensitivity"])
    pos = fppi > 0  # log axis: the empty operating point (0, 0) cannot be drawn
    fig = Figure(figsize=(5, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.step(fppi[pos], sens[pos], where="post", color="C0")
    r = curve["recall_at_fppi"].get(mark)
    if r is None:
        ok = fppi <= mark
        r = float(sens[ok].max()) if ok.any() else 0.0
    ax.plot([mark], [r], "o", color="C3", label=f"R@{mark:g} = {r:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("false positives per image")
    ax.set_ylabel("sensitivity")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    with PathManager.open(out_png, "wb") as f:
        fig.savefig(f, format="png")


def build_evaluator(cfg, dataset_name, output_dir=None, distributed=True):
    """MVCCLClassifier -> ClassificationEvaluator, any detector -> MammoDetectionEvaluator.
    output_dir defaults to <OUTPUT_DIR>/inference/<dataset_name> (not OUTPUT_DIR itself, where
    detectron2's event writer already owns metrics.json)."""
    if output_dir is None:
        output_dir = os.path.join(cfg.OUTPUT_DIR, "inference", dataset_name)
    if cfg.MODEL.META_ARCHITECTURE == "MVCCLClassifier":
        return ClassificationEvaluator(dataset_name, output_dir=output_dir,
                                       distributed=distributed)
    return MammoDetectionEvaluator.from_config(cfg, dataset_name, output_dir,
                                               distributed=distributed)
