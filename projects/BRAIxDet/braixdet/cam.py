"""Algorithm 1: GradCAM pseudo-boxes of the BRAIxMVCCL classifier, their JSON file and quality.

Everything about the GradCAM boxes lives here: the heatmaps (``gradcam_heatmaps``), the boxes of
one heatmap (``cam_boxes_from_heatmap``), labelling a dataset into the resumable JSON file
(``write_cam_boxes``), reading it back for stage 2 (``load_cam_boxes``) and mapping its boxes
into a training batch's frame (``cam_boxes_in_input_frame``), and how many pseudo-boxes hit a
lesion where the boxes are known (``cam_box_quality``).

Heatmap methods (MODEL.BRAIXDET.CAM.METHOD / TARGET_LAYER):
* ``gradcam`` (paper): channel weights = spatial mean of d logit / d A; cam = ReLU(Σ_k w_k A_k).
* ``layercam`` (Jiang et al., TIP 2021): cam = ReLU(Σ_k ReLU(d logit / d A_k) ⊙ A_k), a weight
  per position. The classifier's global-consistency branch max-pools the features, so the
  gradient is concentrated where the lesion is; GradCAM averages that location away. LayerCAM
  keeps it, which is what makes a finer stage (res4, stride 16) usable when lesions span less
  than ~2 cells of the stride-32 map.
* TARGET_LAYER ``"res3+res4+res5"`` (our choice, after Jiang et al.'s multi-stage fusion): the
  min-max normalised maps of each stage, upsampled to the input size, averaged and normalised
  again (τ keeps meaning "fraction of the maximum"). Coarse stages see large lesions, fine ones
  small lesions; one forward/backward pass per stage.

View agreement (SSL.CAM_VIEW_AGREEMENT = δ > 0, applied when stage 2 reads the file; our idea:
the paper's §2.1 avoids nipple-based registration between the views): a lesion lies at about
the same depth from the nipple in CC and MLO. A box of one view is kept only if the other
view's heatmap exceeds τ somewhere within ±δ of the box centre's depth (depth: distance from
the nipple over the breast's depth, in the canonical frame, where the chest wall is at x = 0 and
the nipple is the breast's right-most column). The file stores each box's depth and each map's
depth profile for it. Images whose other view is missing or not labelled keep their boxes.
"""
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from typing import Dict, Iterator, Optional, Sequence, Tuple

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from .utils.io import atomic_write_json
from .utils.modules import unwrap

__all__ = [
    "CamSettings",
    "gradcam_heatmaps",
    "cam_boxes_from_heatmap",
    "scaled_area_limits",
    "boxes_to_original",
    "iter_cam_boxes",
    "cam_box_quality",
    "lesions_hit",
    "boxes_quality",
    "write_cam_boxes",
    "load_cam_boxes",
    "cam_boxes_in_input_frame",
    "nipple_column",
    "depth_profile",
    "box_depths",
    "view_agreement_filter",
]

logger = logging.getLogger(__name__)

METHODS = ("gradcam", "layercam")
FUSED_LAYERS = "res3+res4+res5"
TARGET_LAYERS = ("res5", "res4", "res3", FUSED_LAYERS)
IOU_HIT = 0.2  # a pseudo-box "hits" a lesion at the evaluation's IoU (paper §4.2)
DEPTH_BINS = 64  # resolution of the stored depth profile (view agreement)


def scaled_area_limits(canonical_size, ref_size=(1536, 768), limits=(32**2, 1024**2)):
    """Scale the (min, max) component areas given at ``ref_size`` to ``canonical_size``."""
    s = (canonical_size[0] * canonical_size[1]) / float(ref_size[0] * ref_size[1])
    return limits[0] * s, limits[1] * s


@dataclass(frozen=True)
class CamSettings:
    """What Algorithm 1's output depends on besides the weights and the images."""

    method: str = "gradcam"
    target_layer: str = "res5"
    tau: float = 0.5
    min_area: float = 32**2  # pixels of the canonical input
    max_area: float = 1024**2
    canonical_size: Tuple[int, int] = (1536, 768)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"MODEL.BRAIXDET.CAM.METHOD must be one of {METHODS}, got "
                             f"{self.method!r}")
        if self.target_layer not in TARGET_LAYERS:
            raise ValueError(f"MODEL.BRAIXDET.CAM.TARGET_LAYER must be one of {TARGET_LAYERS},"
                             f" got {self.target_layer!r}")

    @classmethod
    def from_cfg(cls, cfg, tau=None):
        c = cfg.MODEL.BRAIXDET.CAM
        size = tuple(int(v) for v in cfg.INPUT.BRAIXDET.CANONICAL_SIZE)
        lo, hi = scaled_area_limits(size, tuple(c.REF_SIZE), (c.MIN_AREA, c.MAX_AREA))
        return cls(c.METHOD, c.TARGET_LAYER, float(c.TAU if tau is None else tau), lo, hi, size)


def _minmax(cam: torch.Tensor) -> torch.Tensor:
    """Per-image min-max to [0, 1] over the last two dims; a constant map becomes all zero."""
    flat = cam.flatten(1)
    lo = flat.min(dim=1).values[:, None, None]
    span = flat.max(dim=1).values[:, None, None] - lo
    return torch.where(span > 1e-12, (cam - lo) / span.clamp_min(1e-12), torch.zeros_like(cam))


def gradcam_heatmaps(model, batched_inputs, method="gradcam", target_layer="res5",
                     target_size: Optional[Tuple[int, int]] = None):
    """Heatmaps of the malignancy logit on the main views (see the module docstring).

    Computed through the full two-view model, upsampled bilinearly to the input size (then to
    ``target_size`` (H, W) if given) and min-max normalised per image (an all-zero map stays
    zero). Returns (heatmaps float32 (B, H, W) in [0, 1], probabilities float32 (B,)). Runs in
    eval mode (the model's mode is restored) with gradients on, even under torch.no_grad().
    ``target_layer`` "a+b+...": the normalised mean of each stage's map (module docstring).
    """
    if "+" in target_layer:
        per_layer = [gradcam_heatmaps(model, batched_inputs, method, layer, target_size)
                     for layer in target_layer.split("+")]
        fused = _minmax(torch.from_numpy(np.mean([h for h, _ in per_layer], axis=0)))
        return fused.numpy().astype(np.float32), per_layer[0][1]
    model = unwrap(model)
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            acts, logits = model.forward_features(batched_inputs, layer=target_layer)
            # Per-image logits are independent in eval mode: one backward of the sum gives
            # every image's own gradient.
            (grads,) = torch.autograd.grad(logits.sum(), acts)
    finally:
        model.train(was_training)
    b = len(batched_inputs)
    with torch.no_grad():
        acts, grads = acts[:b], grads[:b]  # main views (encoder stages stack main, then aux)
        if method == "gradcam":
            cam = (grads.mean(dim=(2, 3), keepdim=True) * acts).sum(dim=1, keepdim=True)
        else:
            cam = (F.relu(grads) * acts).sum(dim=1, keepdim=True)
        cam = F.relu(cam)
        h, w = batched_inputs[0]["image"].shape[-2:]
        if any(tuple(x["image"].shape[-2:]) != (h, w) for x in batched_inputs):
            raise ValueError("gradcam_heatmaps needs inputs of one (canonical) size")
        div = model.bottom_up.size_divisibility  # ImageList pads the input to a multiple
        stride = (-(-w // div) * div) // cam.shape[-1]
        padded = (cam.shape[-2] * stride, cam.shape[-1] * stride)
        cam = F.interpolate(cam, size=padded, mode="bilinear", align_corners=False)
        cam = cam[:, :, :h, :w]  # drop the ImageList padding (none at canonical sizes)
        if target_size is not None and tuple(target_size) != (h, w):
            cam = F.interpolate(cam, size=tuple(target_size), mode="bilinear",
                                align_corners=False)
        heat = _minmax(cam[:, 0]).clamp_(0, 1)
        probs = torch.sigmoid(logits.detach())
    # float() first: numpy has no bfloat16 (GradCAM under a bf16 autocast)
    return heat.float().cpu().numpy(), probs.float().cpu().numpy()


def cam_boxes_from_heatmap(heatmap: np.ndarray, tau: float = 0.5,
                           min_area: float = 32**2, max_area: float = 1024**2) -> np.ndarray:
    """Algorithm 1 lines 6-15: threshold at τ, 8-connected components, area filter, boxes.

    Returns float32 (K, 4) XYXY boxes in heatmap (canonical) pixels; a component covering pixel
    columns x..x+w-1 gives x0 = x, x1 = x + w (detectron2 XYXY_ABS convention).
    """
    binary = (np.asarray(heatmap) > tau).astype(np.uint8)
    n, _, stats, _ = cv2.connectedComponentsWithStats(binary, connectivity=8)
    boxes = []
    for i in range(1, n):  # 0 is the background
        x, y, w, h, area = stats[i]
        if min_area <= area <= max_area:
            boxes.append([x, y, x + w, y + h])
    return np.asarray(boxes, dtype=np.float32).reshape(-1, 4)


def boxes_to_original(boxes: np.ndarray, tfm, size: Optional[Sequence[int]] = None) -> np.ndarray:
    """Canonical-frame boxes -> original pixels with the original->canonical ``tfm``'s inverse;
    ``size`` (H, W) of the original image, when given, clips the result."""
    boxes = np.asarray(boxes, dtype=np.float64).reshape(-1, 4)
    if len(boxes):
        boxes = np.asarray(tfm.inverse().apply_box(boxes), dtype=np.float64)
        if size is not None:
            boxes[:, 0::2] = boxes[:, 0::2].clip(0, size[1])
            boxes[:, 1::2] = boxes[:, 1::2].clip(0, size[0])
    return boxes.astype(np.float32)


def nipple_column(image) -> int:
    """The canonical image's right-most breast column + 1 (outside the breast is zero)."""
    image = np.asarray(image)
    cols = np.flatnonzero(image.reshape(-1, image.shape[-1]).any(axis=0))
    return int(cols[-1]) + 1 if len(cols) else int(image.shape[-1])


def _depth(x, nipple_x: int) -> np.ndarray:
    """Canonical column position(s) ``x`` as depth: 0 at the nipple, 1 at the chest wall."""
    return np.clip((nipple_x - np.asarray(x, float)) / max(nipple_x, 1), 0.0, 1.0)


def box_depths(boxes: np.ndarray, nipple_x: int) -> np.ndarray:
    """Depth of each canonical XYXY box centre."""
    return _depth(np.asarray(boxes, float).reshape(-1, 4)[:, 0::2].mean(axis=1), nipple_x)


def depth_profile(heatmap: np.ndarray, nipple_x: int, bins=DEPTH_BINS) -> np.ndarray:
    """Per depth bin (0 = nipple ... 1 = chest wall), the heatmap's maximum over those columns."""
    col_max = np.asarray(heatmap, float).max(axis=0)[:nipple_x]
    depth = _depth(np.arange(len(col_max)) + 0.5, nipple_x)  # column centres
    profile = np.zeros(bins)
    np.maximum.at(profile, np.minimum((depth * bins).astype(int), bins - 1), col_max)
    return profile


def view_agreement_filter(images: Dict[str, dict], dicts, delta: float, tau: float):
    """``images`` (image_id -> record with "boxes", "scores", "depths", "profile") with each box
    kept only if the other view's profile exceeds ``tau`` within ±``delta`` of its depth.
    Returns (filtered records, {"kept", "dropped", "unpaired_images"})."""
    aux = {str(d["image_id"]): (None if d.get("aux_missing") else str(d.get("aux_image_id")))
           for d in dicts}
    out, kept, dropped, unpaired = {}, 0, 0, 0
    for image_id, rec in images.items():
        other = images.get(aux.get(image_id) or "")
        if other is None or other.get("profile") is None:
            out[image_id] = rec
            unpaired += 1
            kept += len(rec["boxes"])
            continue
        profile = np.asarray(other["profile"], float)
        centres = (np.arange(len(profile)) + 0.5) / len(profile)
        keep = [bool((profile[np.abs(centres - d) <= delta + 0.5 / len(profile)] > tau).any())
                for d in rec["depths"]]
        out[image_id] = dict(rec, boxes=[b for b, k in zip(rec["boxes"], keep) if k],
                             scores=[s for s, k in zip(rec["scores"], keep) if k],
                             depths=[d for d, k in zip(rec["depths"], keep) if k])
        kept += sum(keep)
        dropped += len(keep) - sum(keep)
    return out, {"kept": kept, "dropped": dropped, "unpaired_images": unpaired}


def iter_cam_boxes(model, mapper, dicts, settings: CamSettings, batch_size=4,
                   desc="GradCAM", with_depths=False) -> Iterator[Tuple]:
    """Yield (dataset dict, mapped input, boxes (K, 4) in ORIGINAL pixels, probability) per
    loadable image (unreadable files are reported by the mapper and skipped); with
    ``with_depths`` also (box depths (K,), depth profile) for the view-agreement filter."""
    s = settings
    for i in tqdm(range(0, len(dicts), batch_size), desc=desc, unit="batch"):
        pairs = [(d, mapper(d)) for d in dicts[i:i + batch_size]]
        pairs = [(d, x) for d, x in pairs if x is not None]
        if not pairs:
            continue
        heatmaps, probs = gradcam_heatmaps(model, [x for _, x in pairs], s.method,
                                           s.target_layer)
        for (d, x), heat, prob in zip(pairs, heatmaps, probs):
            boxes = cam_boxes_from_heatmap(heat, s.tau, s.min_area, s.max_area)
            item = (d, x, boxes_to_original(boxes, x["transforms"], (d["height"], d["width"])),
                    float(prob))
            if with_depths:
                nipple = nipple_column(x["image"].numpy())
                item += (box_depths(boxes, nipple), depth_profile(heat, nipple))
            yield item


def _iou(boxes, gts):
    """(K, N) IoU matrix of XYXY arrays."""
    boxes, gts = np.asarray(boxes, float).reshape(-1, 4), np.asarray(gts, float).reshape(-1, 4)
    lt = np.maximum(boxes[:, None, :2], gts[None, :, :2])
    rb = np.minimum(boxes[:, None, 2:], gts[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(axis=2)
    area = lambda b: (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])  # noqa: E731
    union = area(boxes)[:, None] + area(gts)[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def lesions_hit(boxes, gts) -> np.ndarray:
    """bool (N,): which of the N lesion boxes ``gts`` a pseudo-box hits (IoU ≥ IOU_HIT)."""
    iou = _iou(boxes, gts)
    return (iou >= IOU_HIT).any(axis=0) if len(iou) else np.zeros(len(iou.T), bool)


def known_lesions(d) -> np.ndarray:
    """Malignant boxes of a dict where known: its annotations, or those the protocol withheld."""
    from detectron2.structures import BoxMode

    annos = d.get("annotations") or d.get("withheld_annotations") or []
    return np.asarray([BoxMode.convert(list(a["bbox"]), a.get("bbox_mode", BoxMode.XYXY_ABS),
                                       BoxMode.XYXY_ABS) for a in annos], float).reshape(-1, 4)


def cam_box_quality(boxes_by_image: Dict[str, np.ndarray], dicts) -> dict:
    """Over the images whose lesions are known (boxes withheld by the protocol, or annotated):
    the fraction of pseudo-boxes that hit a lesion (IoU ≥ 0.2) and of lesions hit by one."""
    n_img = n_boxes = box_hits = n_lesions = lesion_hits = 0
    for d in dicts:
        gts = known_lesions(d)
        boxes = boxes_by_image.get(str(d["image_id"]))
        if boxes is None or not len(gts):
            continue
        iou = _iou(boxes, gts)
        n_img += 1
        n_boxes += len(iou)
        box_hits += int((iou >= IOU_HIT).any(axis=1).sum())
        n_lesions += len(gts)
        lesion_hits += int(lesions_hit(boxes, gts).sum())
    return {"images_with_known_lesions": n_img, "boxes": n_boxes, "lesions": n_lesions,
            "box_hit_rate": box_hits / n_boxes if n_boxes else float("nan"),
            "lesion_hit_rate": lesion_hits / n_lesions if n_lesions else float("nan")}


def boxes_quality(images: Dict[str, dict], dicts) -> dict:
    """``cam_box_quality`` of records as written (image_id -> {"boxes", ...})."""
    return cam_box_quality({k: np.asarray(v["boxes"]).reshape(-1, 4) for k, v in images.items()},
                           dicts)


def _file_digest(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _image_identity(d):
    """An image's id and, when it names a file, the file's path, size and mtime."""
    path = d.get("file_name")
    try:
        st = os.stat(path) if path else None
    except OSError:
        st = None
    return f"{d['image_id']}|{path}|{st.st_size if st else ''}|{st.st_mtime_ns if st else ''}"


def fingerprint(weights: str, settings: CamSettings, dataset: str, dicts, mapper=None) -> dict:
    """What a (partial) output depends on, i.e. everything that changes its pixels or boxes:
    weights content, CAM settings (method, layer, τ, area limits, canonical size), the mapper's
    preprocessing key (version, canonical size, MASK_MARGIN, MASK_DOWNSAMPLE), the dataset and
    its images (ids and files)."""
    ids = "\n".join(sorted(_image_identity(d) for d in dicts))
    params = getattr(mapper, "params", None)
    return {"weights_sha256": _file_digest(weights), "settings": asdict(settings),
            "preprocess": params.key() if params is not None else None,
            "dataset": dataset, "images_sha256": hashlib.sha256(ids.encode()).hexdigest()}


def _jsonable(fp):
    return json.loads(json.dumps(fp))  # tuples -> lists, as read back from the file


def _read_partial(partial, fp):
    """Records of an interrupted run with the same fingerprint; anything else starts fresh."""
    if os.path.islink(partial):  # planted: the appends below must not follow it
        logger.warning("%s is a symbolic link: removed, starting fresh", partial)
        os.remove(partial)
        return {}
    if not os.path.exists(partial):
        return {}
    done = {}
    with open(partial) as f:
        try:
            head = json.loads(f.readline())
        except json.JSONDecodeError:
            head = None
        if not isinstance(head, dict) or head.get("fingerprint") != _jsonable(fp):
            logger.warning("%s was written for other weights, settings or images; starting "
                           "fresh", partial)
            os.remove(partial)
            return {}
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                break  # a torn last line from a killed run
            done[rec.pop("image_id")] = rec
    logger.info("resuming %s: %d images already labelled", partial, len(done))
    return done


def write_cam_boxes(out, model, mapper, dicts, settings: CamSettings, weights: str,
                    dataset: str, batch_size=4) -> dict:
    """Algorithm 1 over ``dicts`` (weak images with label 1) -> JSON ``out``; returns it.

    ``out`` = {"meta": {fingerprint, counts, quality}, "images": {image_id: {"boxes": [[x0, y0,
    x1, y1] original px], "scores": [p]}}}. Progress goes to ``out.partial.jsonl`` (first line:
    the fingerprint), so a killed run resumes, but only with the same weights, settings and
    images: otherwise it starts fresh and says so.
    """
    fp = fingerprint(weights, settings, dataset, dicts, mapper)
    partial = out + ".partial.jsonl"
    done = _read_partial(partial, fp)
    if not done:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(partial, "w") as f:
            f.write(json.dumps({"fingerprint": fp}) + "\n")
    todo = [d for d in dicts if str(d["image_id"]) not in done]
    with open(partial, "a") as f:
        for d, _, boxes, prob, depths, profile in iter_cam_boxes(
                model, mapper, todo, settings, batch_size, with_depths=True):
            image_id = str(d["image_id"])
            rec = {"boxes": boxes.round(2).tolist(), "scores": [prob] * len(boxes),
                   "depths": depths.round(4).tolist(), "profile": profile.round(4).tolist()}
            f.write(json.dumps({"image_id": image_id, **rec}) + "\n")
            f.flush()
            done[image_id] = rec

    result = {"meta": {"fingerprint": fp, "num_images": len(done),
                       "num_boxes": sum(len(v["boxes"]) for v in done.values()),
                       "quality": boxes_quality(done, dicts)},
              "images": done}
    atomic_write_json(out, result)
    os.remove(partial)
    return result


def load_cam_boxes(path: str, dicts=None, view_agreement: float = 0.0) -> Dict[str, dict]:
    """image_id -> {"boxes" (original px), "scores", ...} from a ``write_cam_boxes`` file; with
    ``view_agreement`` δ > 0 after the view-agreement filter, pairing by ``dicts``."""
    with open(path) as f:
        data = json.load(f)
    images = data.get("images", data)
    if view_agreement <= 0:
        return images
    if any("profile" not in v for v in images.values()):
        raise ValueError(f"{path}: no depth profiles (written by an older version): rerun "
                         "tools/gradcam_pseudo_labels.py to use SSL.CAM_VIEW_AGREEMENT")
    tau = data.get("meta", {}).get("fingerprint", {}).get("settings", {}).get("tau", 0.5)
    kept, counts = view_agreement_filter(images, dicts or [], view_agreement, tau)
    quality = boxes_quality(kept, dicts or [])
    logger.info("View agreement (δ=%g): %d CAM boxes kept, %d dropped (%d images without a "
                "labelled other view); %.1f%% of the boxes hit a lesion where known (%.1f%% "
                "before)", view_agreement, counts["kept"], counts["dropped"],
                counts["unpaired_images"], 100 * quality["box_hit_rate"],
                100 * boxes_quality(images, dicts or [])["box_hit_rate"])
    return kept


def cam_boxes_in_input_frame(batched_inputs, lookup) -> Dict[str, Tuple[torch.Tensor,
                                                                          torch.Tensor]]:
    """Each input's GradCAM boxes mapped from original pixels into its (augmented) input frame.

    The mapper's ``transforms`` (preprocessing) and ``aug_transforms`` (training augmentation,
    e.g. the vertical flip the teacher also saw) are applied in turn.
    """
    out = {}
    for x in batched_inputs:
        entry = lookup.get(str(x["image_id"]))
        if not entry or not entry.get("boxes"):
            continue
        boxes = np.asarray(entry["boxes"], dtype=np.float64).reshape(-1, 4)
        boxes = x["transforms"].apply_box(boxes)
        if x.get("aug_transforms") is not None:
            boxes = x["aug_transforms"].apply_box(boxes)
        scores = np.asarray(entry.get("scores", [1.0] * len(boxes)), dtype=np.float32)
        out[str(x["image_id"])] = (torch.as_tensor(boxes, dtype=torch.float32),
                                   torch.as_tensor(scores))
    return out
