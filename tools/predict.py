#!/usr/bin/env python
"""Detect malignant lesions in DICOM mammograms: files or folders in, boxes in original pixels out.

  python tools/predict.py --config-file configs/BRAIxDet/braixdet.yaml \
      --weights output/braixdet/model_final_teacher.pth --input /exams/ --out predictions/

Images are grouped into exams (StudyInstanceUID) and breasts (laterality) from their tags, CC and
MLO are paired, and every image is the main view once with its partner as auxiliary view (a
missing partner: the image is its own auxiliary view, as in training, and reported). Backbone
features are computed once per image per exam (``--no-share-features`` recomputes per pair).
Writes ``predictions.json`` (SOPInstanceUID, laterality, view, boxes in original DICOM pixel
coordinates, scores; no patient identifiers or paths) and overlay PNGs named by SOPInstanceUID
(sanitised: a crafted UID cannot write outside --out).
"""
import argparse
import json
import logging
import os
from collections import defaultdict

import numpy as np
import torch
from detectron2.modeling import build_model
from detectron2.utils.logger import setup_logger
from tqdm import tqdm

from braixdet.data.dicom import read_dicom_image, read_dicom_meta
from braixdet.data.preprocess import PreprocessParams, canonicalize
from braixdet.data.report import BadInputError, BadInputReport
from braixdet.engine.setup import build_cfg, load_inference_weights
from braixdet.utils import safe_output_path

logger = logging.getLogger("braixdet.predict")
DICOM_SUFFIXES = (".dcm", ".dicom", "")


def find_dicoms(inputs):
    files = []
    for p in inputs:
        if os.path.isdir(p):
            for dirpath, _, names in os.walk(p):
                files += [os.path.join(dirpath, n) for n in sorted(names)
                          if os.path.splitext(n)[1].lower() in DICOM_SUFFIXES]
        else:
            files.append(p)
    return sorted(files)


def group_exams(files, report, allow_for_processing=False):
    """{study_uid: {laterality: {view: [meta, ...]}}} from the DICOM tags; bad files reported."""
    exams = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for f in files:
        try:
            meta = read_dicom_meta(f, allow_for_processing=allow_for_processing)
        except BadInputError as e:
            report.add(e)
            continue
        if meta.laterality not in ("L", "R") or meta.view not in ("CC", "MLO"):
            report.add(BadInputError(f, "unknown_view", f"laterality={meta.laterality} "
                                                        f"view={meta.view}"))
            continue
        exams[meta.study_uid][meta.laterality][meta.view].append(meta)
    return exams


def pair_breast(views, report):
    """[(main_meta, aux_meta or None)] for one breast: each image main once, CC <-> MLO."""
    pairs = []
    for view, other in (("CC", "MLO"), ("MLO", "CC")):
        for meta in sorted(views.get(view, []), key=lambda m: m.sop_uid):
            partners = sorted(views.get(other, []), key=lambda m: m.sop_uid)
            if not partners:
                report.count("aux_missing")
            pairs.append((meta, partners[0] if partners else None))
    return pairs


class ExamPredictor:
    def __init__(self, cfg, weights, share_features=True):
        self.cfg = cfg
        self.model = build_model(cfg)
        load_inference_weights(self.model, weights)
        self.model.eval()
        self.params = PreprocessParams.from_cfg(cfg)
        self.share_features = share_features
        self.allow_fp = cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING

    def load(self, meta):
        img, _ = read_dicom_image(meta.path, allow_for_processing=self.allow_fp)
        canonical, tfm, _ = canonicalize(img, meta.laterality, self.params)
        return img, torch.from_numpy(np.ascontiguousarray(canonical))[None], tfm

    @torch.no_grad()
    def predict_exam(self, pairs):
        """pairs: [(main_meta, aux_meta|None)] of one exam -> [(main_meta, Instances, image)]."""
        metas = {}
        for main, aux in pairs:
            for m in (main, aux):
                if m is not None:
                    metas[m.sop_uid] = m
        order = sorted(metas)
        loaded = {uid: self.load(metas[uid]) for uid in order}
        idx = {uid: i for i, uid in enumerate(order)}
        images = [loaded[uid][1] for uid in order]
        index_pairs = [(idx[m.sop_uid], idx[(a or m).sop_uid]) for m, a in pairs]
        transforms = [loaded[uid][2] for uid in order]  # per image, as inference_exam expects
        sizes = [tuple(loaded[uid][0].shape) for uid in order]
        if self.share_features:
            outs = [o["instances"] for o in self.model.inference_exam(
                images, index_pairs, transforms=transforms, sizes=sizes)]
        else:
            outs = []
            for mi, ai in index_pairs:
                inp = {"image": images[mi], "aux_image": images[ai], "transforms": transforms[mi],
                       "height": sizes[mi][0], "width": sizes[mi][1]}
                outs.append(self.model([inp])[0]["instances"])
        return [(m, inst.to("cpu"), loaded[m.sop_uid][0]) for (m, _), inst in zip(pairs, outs)]


def detections_record(meta, inst, aux_missing, score_thresh):
    keep = inst.scores >= score_thresh
    boxes = inst.pred_boxes.tensor[keep].tolist()
    scores = inst.scores[keep].tolist()
    return {"sop_instance_uid": meta.sop_uid, "laterality": meta.laterality,
            "view": meta.view, "aux_missing": aux_missing, "height": int(inst.image_size[0]),
            "width": int(inst.image_size[1]),
            "detections": [{"box_xyxy": [round(v, 1) for v in b], "score": round(s, 5)}
                           for b, s in zip(boxes, scores)]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config-file", required=True)
    ap.add_argument("--weights", required=True, help="teacher export or stage-2 checkpoint")
    ap.add_argument("--input", nargs="+", required=True, help="DICOM files or folders")
    ap.add_argument("--out", required=True)
    ap.add_argument("--score-thresh", type=float, default=0.05, help="kept in the JSON")
    ap.add_argument("--overlay-thresh", type=float, default=0.3, help="drawn on the PNGs")
    ap.add_argument("--no-overlays", action="store_true")
    ap.add_argument("--no-share-features", action="store_true")
    ap.add_argument("opts", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    setup_logger(name="braixdet")
    cfg = build_cfg(args.config_file, ["MODEL.BRAIXDET.INIT_FROM_CLASSIFIER", "", *args.opts])
    cfg.freeze()
    os.makedirs(args.out, exist_ok=True)
    report = BadInputReport("predict")
    exams = group_exams(find_dicoms(args.input), report, cfg.INPUT.BRAIXDET.ALLOW_FOR_PROCESSING)
    predictor = ExamPredictor(cfg, args.weights, share_features=not args.no_share_features)
    records = []
    for exam_no, study in enumerate(tqdm(sorted(exams), desc="exams", unit="exam")):
        pairs = [p for lat in sorted(exams[study]) for p in pair_breast(exams[study][lat], report)]
        try:
            results = predictor.predict_exam(pairs)
        except BadInputError as e:  # one unreadable image: report it, go on with other exams
            report.add(e)
            continue
        for (meta, inst, image), (_, aux) in zip(results, pairs):
            rec = detections_record(meta, inst, aux is None, args.score_thresh)
            rec["exam"] = exam_no
            records.append(rec)
            if not args.no_overlays:
                from braixdet.evaluation.overlay import draw_overlay

                keep = inst.scores >= args.overlay_thresh
                draw_overlay(image, [], inst.pred_boxes.tensor[keep].numpy(),
                             inst.scores[keep].numpy(),
                             safe_output_path(args.out, meta.sop_uid, ".png"))
    with open(os.path.join(args.out, "predictions.json"), "w") as f:
        json.dump({"images": records, "report": report.to_dict()["counts"]}, f, indent=1)
    report.save(os.path.join(args.out, "report.json"))
    print(report.summary())
    print(f"wrote {len(records)} image predictions to {args.out}/predictions.json")
    return records


if __name__ == "__main__":
    main()
