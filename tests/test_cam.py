"""Algorithm 1 (GradCAM pseudo-boxes): post-processing, GradCAM / LayerCAM vs pytorch-grad-cam,
a blob a trained classifier finds, the JSON's resume fingerprint and the quality report."""
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _cfg_helpers import tiny_classifier_cfg
from detectron2.data import DatasetCatalog
from detectron2.data.transforms import (
    CropTransform,
    HFlipTransform,
    ResizeTransform,
    TransformList,
)
from detectron2.modeling import build_model
from torch import nn

import braixdet.modeling  # noqa: F401
from braixdet.cam import (
    FUSED_LAYERS,
    CamSettings,
    _minmax,
    box_depths,
    boxes_to_original,
    cam_box_quality,
    cam_boxes_from_heatmap,
    depth_profile,
    gradcam_heatmaps,
    known_lesions,
    load_cam_boxes,
    nipple_column,
    scaled_area_limits,
    view_agreement_filter,
    write_cam_boxes,
)
from braixdet.config import check_config

H, W = 128, 64


# --- Algorithm 1 post-processing ---------------------------------------------------------------

def test_threshold_components_and_area_filter():
    h = np.zeros((200, 100), np.float32)
    h[10:30, 5:25] = 0.9  # A: 20x20 = 400 px -> kept
    h[50:53, 50:53] = 0.8  # B: 9 px -> below min_area
    h[100:190, 10:90] = 0.7  # C: 90x80 = 7200 px -> above max_area
    h[60:70, 60:70] = 0.6  # D: 10x10 ...
    h[70:75, 70:75] = 0.6  # ... + 5x5 touching D only at a corner: one 8-connected component
    h[5:40, 80:95] = 0.5  # E: exactly tau -> not above the threshold, ignored
    boxes = cam_boxes_from_heatmap(h, tau=0.5, min_area=16, max_area=5000)
    assert boxes.dtype == np.float32 and boxes.shape == (2, 4)
    got = sorted(map(tuple, boxes.tolist()))
    assert got == [(5, 10, 25, 30), (60, 60, 75, 75)]  # xyxy, right/bottom exclusive
    # the area filter is inclusive at both limits
    assert len(cam_boxes_from_heatmap(h, 0.5, min_area=400, max_area=400)) == 1
    # nothing above tau -> no boxes, right shape
    assert cam_boxes_from_heatmap(np.zeros((8, 8)), 0.5, 1, 100).shape == (0, 4)
    # no area filter: A, B, C, D (4-connectivity would split D; 8-connectivity keeps it whole)
    all_boxes = cam_boxes_from_heatmap(h, 0.55, min_area=1, max_area=1e9)
    assert len(all_boxes) == 4 and [60, 60, 75, 75] in all_boxes.tolist()


def test_scaled_area_limits():
    assert scaled_area_limits((1536, 768)) == (32**2, 1024**2)
    lo, hi = scaled_area_limits((768, 384))
    assert lo == pytest.approx(32**2 / 4) and hi == pytest.approx(1024**2 / 4)
    assert scaled_area_limits((128, 64), limits=(10, 20)) == pytest.approx(
        (10 * 128 * 64 / (1536 * 768), 20 * 128 * 64 / (1536 * 768)))


def _flip_crop_resize():
    """original 400x300 (H, W) -> crop (x 50..250, y 20..380) -> hflip -> resize to 128x64."""
    return TransformList([
        CropTransform(50, 20, 200, 360, orig_w=300, orig_h=400),
        HFlipTransform(200),
        ResizeTransform(360, 200, H, W),
    ])


def test_boxes_to_original_flip_crop_resize():
    tfm = _flip_crop_resize()
    orig = np.array([[60.0, 100.0, 120.0, 180.0], [200.0, 300.0, 240.0, 370.0]])
    canon = tfm.apply_box(orig)
    # the flip sends the leftmost original box to the right of the canonical frame
    assert canon[0, 0] > canon[1, 0]
    back = boxes_to_original(canon, tfm)
    assert back.dtype == np.float32 and np.allclose(back, orig, atol=1e-3)
    assert boxes_to_original(np.zeros((0, 4)), tfm).shape == (0, 4)
    clipped = boxes_to_original(np.array([[0.0, 0.0, W, H]]), tfm, size=(100, 100))
    assert clipped.max() <= 100

    # full Algorithm 1 path: heatmap blob on the canonical grid -> box -> original pixels
    heat = np.zeros((H, W), np.float32)
    x0, y0, x1, y1 = np.round(canon[0]).astype(int)
    heat[y0:y1, x0:x1] = 1.0
    (box,) = cam_boxes_from_heatmap(heat, 0.5, min_area=4, max_area=H * W)
    mapped = boxes_to_original(box[None], tfm, size=(400, 300))[0]
    # within one canonical pixel (200/64 x, 360/128 y original px) of the true box
    assert np.all(np.abs(mapped - orig[0]) <= np.array([3.2, 2.9, 3.2, 2.9]))


def test_minmax_keeps_all_zero_maps_zero():
    cam = torch.zeros(2, 4, 4)
    cam[1, 1, 1] = 3.0
    out = _minmax(cam)
    assert torch.equal(out[0], torch.zeros(4, 4)) and out[1].max() == 1 and out[1].min() == 0


# --- GradCAM ------------------------------------------------------------------------------------

def _blob(g):
    yy, xx = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    cy = torch.randint(16, H - 16, (2,), generator=g)
    cx = torch.randint(8, W - 8, (2,), generator=g)
    img = 0.2 * torch.rand(H, W, generator=g)
    for y, x in zip(cy.tolist(), cx.tolist()):
        img += 0.6 * torch.exp(-((yy - y) ** 2 + (xx - x) ** 2) / 50.0)
    return img.clamp(0, 1)[None]


@pytest.fixture(scope="module", params=[True, False], ids=["multi_view", "single_view"])
def classifier(request):
    torch.manual_seed(0)
    model = build_model(tiny_classifier_cfg(multi_view=request.param))
    g = torch.Generator().manual_seed(1)
    inputs = [{"image": _blob(g), "aux_image": _blob(g), "label": 1} for _ in range(2)]
    # realistic BN statistics (random-init nets collapse in eval mode with running stats 0/1)
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    with torch.no_grad():
        model.train().forward_tensor(model.preprocess_image(inputs).tensor)
    for m in bns:
        m.momentum = 0.1
    model.eval()
    return model, inputs


class _StackedInput(nn.Module):
    """pytorch-grad-cam calls model(tensor): feed the normalised stacked [main, aux] tensor."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model.forward_tensor(x)[0][:, None]


def test_gradcam_matches_pytorch_grad_cam(classifier):
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    model, inputs = classifier
    # Algorithm 1's target: the encoder's last stage (res5, u_m), main views first
    layer = _encoder_stage(model, "res5")
    with torch.no_grad():  # must re-enable gradients itself
        heat, probs = gradcam_heatmaps(model, inputs)
    assert not model.training
    assert heat.dtype == np.float32 and heat.shape == (2, H, W)
    assert heat.min() >= 0 and heat.max() <= 1 and np.allclose(heat.max(axis=(1, 2)), 1)
    with torch.no_grad():
        ref_probs = torch.stack([o["prob"] for o in model(inputs)]).numpy()
    assert np.allclose(probs, ref_probs, atol=1e-6)

    x = model.preprocess_image(inputs).tensor
    with GradCAM(model=_StackedInput(model), target_layers=[layer]) as cam:
        ref = cam(input_tensor=x, targets=[ClassifierOutputTarget(0)] * len(inputs))
    # multi-view: the hooked stage sees [main, aux] stacked, pytorch-grad-cam returns both
    ref = ref[: len(inputs)]
    assert ref.shape == heat.shape
    assert np.abs(heat - ref).max() < 1e-5

    # resizing to another target size keeps [0, 1] and the peak
    big, _ = gradcam_heatmaps(model.train(), inputs, target_size=(2 * H, 2 * W))
    assert model.training  # mode restored
    model.eval()
    assert big.shape == (2, 2 * H, 2 * W) and np.allclose(big.max(axis=(1, 2)), 1)


def _encoder_stage(model, layer):
    """The timm module whose output is encoder stage ``layer`` (e.g. res4)."""
    enc = model.bottom_up.encoder
    idx = enc._out_features.index(layer)
    return enc.body.get_submodule(enc.body.feature_info.module_name()[idx])


def test_layercam_at_res4_matches_pytorch_grad_cam():
    """LayerCAM on the main view's res4 (encoder stage, both views through one call) equals
    pytorch-grad-cam's LayerCAM on that module, main rows."""
    from pytorch_grad_cam import LayerCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    cfg = tiny_classifier_cfg(multi_view=True)
    cfg.MODEL.BRAIXDET.CAM.TARGET_LAYER = "res4"
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert "res4" in model.bottom_up.encoder._out_features  # added for the CAM target
    g = torch.Generator().manual_seed(1)
    inputs = [{"image": _blob(g), "aux_image": _blob(g), "label": 1} for _ in range(2)]
    heat, _ = gradcam_heatmaps(model, inputs, method="layercam", target_layer="res4")
    x = model.preprocess_image(inputs).tensor
    with LayerCAM(model=_StackedInput(model), target_layers=[_encoder_stage(model, "res4")]) as c:
        ref = c(input_tensor=x, targets=[ClassifierOutputTarget(0)] * len(inputs))
    # the hooked module sees [main, aux] stacked: pytorch-grad-cam returns both, mains first
    assert ref.shape == (2 * len(inputs), H, W)
    assert np.abs(heat - ref[: len(inputs)]).max() < 1e-4


def test_fused_map_is_the_normalised_mean_of_the_stage_maps():
    """TARGET_LAYER "res3+res4+res5": the min-max normalised mean of the three LayerCAM maps
    (each normalised at the input size); the classifier builds every stage for it."""
    cfg = tiny_classifier_cfg(multi_view=True)
    cfg.MODEL.BRAIXDET.CAM.METHOD = "layercam"
    cfg.MODEL.BRAIXDET.CAM.TARGET_LAYER = FUSED_LAYERS
    check_config(cfg)
    assert CamSettings.from_cfg(cfg).target_layer == FUSED_LAYERS
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    assert {"res3", "res4", "res5"} <= set(model.bottom_up.encoder._out_features)
    g = torch.Generator().manual_seed(2)
    inputs = [{"image": _blob(g), "aux_image": _blob(g), "label": 1} for _ in range(2)]
    fused, probs = gradcam_heatmaps(model, inputs, "layercam", FUSED_LAYERS)
    maps = [gradcam_heatmaps(model, inputs, "layercam", layer)[0]
            for layer in ("res3", "res4", "res5")]
    mean = np.mean(maps, axis=0)
    lo = mean.min(axis=(1, 2), keepdims=True)
    ref = (mean - lo) / (mean.max(axis=(1, 2), keepdims=True) - lo)
    assert fused.shape == (2, H, W) and np.abs(fused - ref).max() < 1e-6
    assert not np.allclose(fused, maps[2], atol=1e-3)  # res3/res4 change the res5 map
    assert np.allclose(probs, gradcam_heatmaps(model, inputs, "layercam", "res5")[1])
    cfg.MODEL.BRAIXDET.CAM.TARGET_LAYER = "res2+res5"
    with pytest.raises(ValueError, match="TARGET_LAYER"):
        check_config(cfg)


def test_res5_map_sees_the_max_pooled_evidence():
    """Only the GCM's max-pool of u_m reads the lesion (the average-pooled branch and the aux
    view silenced): the res5 map must still peak where that maximum is. On the LCM output
    ũ_m (the former target) the gradient is the same at every position and the map could not."""
    torch.manual_seed(0)
    model = build_model(tiny_classifier_cfg(multi_view=True)).eval()
    c = model.bottom_up.output_shape()["res5"].channels
    with torch.no_grad():
        first = model.head[0]
        first.weight[:, c:] = 0  # GAP(ũ_m), GAP(ũ_a): silenced
        model.gcm.proj.weight.zero_()  # P(g_a): silenced
        model.gcm.proj.bias.zero_()
    g = torch.Generator().manual_seed(1)
    inputs = [{"image": _blob(g), "aux_image": _blob(g), "label": 1}]
    acts, logits = model.forward_features(inputs)
    (grads,) = torch.autograd.grad(logits.sum(), acts)
    # per channel, the gradient lives only where that channel attains its maximum
    a, gr = acts[0].detach().flatten(1), grads[0].flatten(1)
    at_max = torch.zeros_like(gr, dtype=torch.bool)
    at_max[torch.arange(len(a)), a.argmax(1)] = True
    assert gr[~at_max].abs().max() == 0 and gr[at_max].abs().sum() > 0
    heat, _ = gradcam_heatmaps(model, inputs, method="layercam", target_layer="res5")
    cam = (F.relu(grads[:1]) * acts[:1].detach()).sum(1)[0]
    yy, xx = np.unravel_index(int(cam.argmax()), cam.shape)
    stride = H // cam.shape[0]
    peak = np.unravel_index(heat[0].argmax(), heat[0].shape)
    assert yy * stride <= peak[0] < (yy + 1) * stride and xx * stride <= peak[1] < (xx + 1) * stride


def _blob_image(rng, center=None):
    img = 0.25 + 0.05 * rng.standard_normal((H, W)).astype(np.float32)
    if center is not None:
        yy, xx = np.mgrid[:H, :W]
        img += 0.6 * np.exp(-((yy - center[0]) ** 2 + (xx - center[1]) ** 2) / 18.0)
    return torch.from_numpy(img.clip(0, 1))[None]


def test_a_trained_classifier_puts_the_box_on_the_bright_blob():
    """A classifier (ImageNet Lite0 encoder, the offline source) trained to tell images with a
    bright blob from plain ones: on a new image, Algorithm 1's box lies on the blob (GradCAM at
    res5 contains it, LayerCAM at res4 fits it at IoU >= 0.2)."""
    torch.manual_seed(0)
    cfg = tiny_classifier_cfg(multi_view=True)
    cfg.MODEL.BRAIXDET.CAM.TARGET_LAYER = "res4"
    cfg.MODEL.BRAIXDET.TIMM_MODEL = "tf_efficientnet_lite0"
    cfg.MODEL.BRAIXDET.PRETRAINED = "efficientnet-lite0-package"
    cfg.MODEL.PIXEL_MEAN, cfg.MODEL.PIXEL_STD = [0.5], [0.5]
    model = build_model(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    rng = np.random.default_rng(0)

    def sample(label):
        c = (rng.integers(20, H - 20), rng.integers(12, W - 12)) if label else None
        img = _blob_image(rng, c)
        return {"image": img, "aux_image": img, "label": label}

    model.train()
    for _ in range(40):
        batch = [sample(i % 2) for i in range(8)]
        loss = sum(model(batch).values())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    center = (90, 20)
    test = [{"image": _blob_image(rng, center), "aux_image": _blob_image(rng, center)}]
    r = 6  # where the blob adds more than 10% of its peak: exp(-r^2 / 18) = 0.1
    blob = np.array([center[1] - r, center[0] - r, center[1] + r, center[0] + r], float)
    for method, layer in (("gradcam", "res5"), ("layercam", "res4")):
        heat, prob = gradcam_heatmaps(model, test, method, layer)
        assert prob[0] > 0.5, (method, prob)
        boxes = cam_boxes_from_heatmap(heat[0], 0.5, 4, H * W)
        assert len(boxes), method
        top = boxes[np.argmax([heat[0][int(b[1]):int(b[3]), int(b[0]):int(b[2])].max()
                               for b in boxes])]
        assert top[0] <= center[1] <= top[2] and top[1] <= center[0] <= top[3], (method, top)
        if layer == "res4":
            iou = cam_box_quality({"x": boxes}, [{"image_id": "x", "annotations": [
                {"bbox": blob.tolist(), "bbox_mode": 0}]}])["lesion_hit_rate"]
            assert iou == 1.0, boxes


def test_quality_counts_hits_on_withheld_boxes():
    dicts = [
        {"image_id": "a", "withheld_annotations": [{"bbox": [0, 0, 10, 10], "bbox_mode": 0},
                                                   {"bbox": [50, 50, 60, 60], "bbox_mode": 0}]},
        {"image_id": "b", "annotations": [{"bbox": [0, 0, 10, 10], "bbox_mode": 0}]},
        {"image_id": "c"},  # lesions unknown: not counted
    ]
    boxes = {"a": np.array([[1, 1, 11, 11], [20, 20, 30, 30]]), "b": np.zeros((0, 4)),
             "c": np.array([[0, 0, 5, 5]])}
    q = cam_box_quality(boxes, dicts)
    assert q == {"images_with_known_lesions": 2, "boxes": 2, "lesions": 3,
                 "box_hit_rate": 0.5, "lesion_hit_rate": 1 / 3}


class _FakeMapper:
    """Maps a dict to an input whose boxes are in the canonical = original frame."""

    def __call__(self, d):
        from detectron2.data.transforms import NoOpTransform, TransformList

        return {"image": _blob(torch.Generator().manual_seed(int(d["image_id"][1:]))),
                "aux_image": torch.zeros(1, H, W), "label": 1, "image_id": d["image_id"],
                "transforms": TransformList([NoOpTransform()])}


def test_depths_and_profile_are_measured_from_the_nipple():
    image = np.zeros((1, 4, 10))
    image[0, :, :8] = 1  # columns 8-9: padding beyond the nipple
    assert nipple_column(image) == 8
    np.testing.assert_allclose(box_depths([[6, 0, 8, 2], [0, 0, 2, 2]], 8), [1 / 8, 7 / 8])
    heat = np.zeros((4, 10))
    heat[1, 2], heat[2, 6], heat[3, 9] = 0.9, 0.4, 1.0  # column 9 lies outside the breast
    # column c's depth is (8 - c - 0.5) / 8: c = 2 -> 0.6875 (bin 2 of 4), c = 6 -> 0.1875
    np.testing.assert_allclose(depth_profile(heat, 8, bins=4), [0.4, 0, 0.9, 0])


def test_view_agreement_keeps_boxes_the_other_view_confirms():
    profile = lambda *hot: [0.8 if k in hot else 0.1 for k in range(4)]  # noqa: E731
    images = {
        "cc": {"boxes": [[0, 0, 1, 1], [2, 2, 3, 3]], "scores": [0.9, 0.9],
               "depths": [0.2, 0.7], "profile": profile(0, 3)},  # bin centres .125 ... .875
        "mlo": {"boxes": [[4, 4, 5, 5]], "scores": [0.8], "depths": [0.1],
                "profile": profile(0)},
        "alone": {"boxes": [[0, 0, 2, 2]], "scores": [0.7], "depths": [0.5],
                  "profile": profile()},
        "other_not_labelled": {"boxes": [[0, 0, 2, 2]], "scores": [0.7], "depths": [0.9],
                               "profile": profile()},
    }
    dicts = [{"image_id": "cc", "aux_image_id": "mlo"}, {"image_id": "mlo", "aux_image_id": "cc"},
             {"image_id": "alone", "aux_image_id": "alone", "aux_missing": True},
             {"image_id": "other_not_labelled", "aux_image_id": "x"}]
    kept, counts = view_agreement_filter(images, dicts, delta=0.1, tau=0.5)
    # cc's box at depth 0.7 has nothing within ±0.1 (+ half a bin) in the MLO profile
    assert kept["cc"]["boxes"] == [[0, 0, 1, 1]] and kept["cc"]["depths"] == [0.2]
    assert kept["cc"]["scores"] == [0.9]
    assert kept["mlo"]["boxes"] == [[4, 4, 5, 5]]
    assert kept["alone"] == images["alone"] and kept["other_not_labelled"]["boxes"]
    assert counts == {"kept": 4, "dropped": 1, "unpaired_images": 2}
    # a wide enough window keeps everything
    assert view_agreement_filter(images, dicts, delta=0.6, tau=0.5)[1]["dropped"] == 0


def test_written_file_feeds_the_view_agreement_filter(classifier, tmp_path):
    """The file keeps each box's depth and each map's profile; load_cam_boxes filters with them
    (SSL.CAM_VIEW_AGREEMENT) and leaves them alone at δ = 0."""
    model, _ = classifier
    dicts = [{"image_id": f"i{k}", "height": H, "width": W, "label": 1,
              "aux_image_id": f"i{1 - k}"} for k in range(2)]
    (tmp_path / "w.pth").write_bytes(b"w")
    out = str(tmp_path / "cam.json")
    s = CamSettings(tau=0.5, min_area=1, max_area=H * W, canonical_size=(H, W))
    res = write_cam_boxes(out, model, _FakeMapper(), dicts, s, str(tmp_path / "w.pth"), "ds", 2)
    rec = res["images"]["i0"]
    assert len(rec["depths"]) == len(rec["boxes"]) and len(rec["profile"]) == 64
    nipple = nipple_column(_FakeMapper()(dicts[0])["image"].numpy())
    np.testing.assert_allclose(rec["depths"], box_depths(rec["boxes"], nipple), atol=1e-4)
    assert load_cam_boxes(out, dicts, 0.0) == res["images"]
    expected, _ = view_agreement_filter(res["images"], dicts, 0.05, 0.5)
    assert load_cam_boxes(out, dicts, 0.05) == expected
    legacy = tmp_path / "legacy.json"
    legacy.write_text(json.dumps({"images": {"i0": {"boxes": [], "scores": []}}}))
    with pytest.raises(ValueError, match="no depth profiles"):
        load_cam_boxes(str(legacy), dicts, 0.05)


def test_resume_only_with_the_same_weights_and_settings(classifier, tmp_path, caplog):
    model, _ = classifier
    dicts = [{"image_id": f"i{k}", "height": H, "width": W, "label": 1} for k in range(3)]
    w1, w2 = tmp_path / "w1.pth", tmp_path / "w2.pth"
    w1.write_bytes(b"one")
    w2.write_bytes(b"two")
    out = str(tmp_path / "cam.json")
    settings = CamSettings(tau=0.5, min_area=1, max_area=H * W, canonical_size=(H, W))
    # a killed run with weights w1 left one (fake) record behind
    from braixdet.cam import fingerprint

    fake = {"image_id": "i0", "boxes": [[1, 2, 3, 4]], "scores": [0.5]}
    with open(out + ".partial.jsonl", "w") as f:
        f.write(json.dumps({"fingerprint": fingerprint(str(w1), settings, "ds", dicts)}) + "\n")
        f.write(json.dumps(fake) + "\n")
    res = write_cam_boxes(out, model, _FakeMapper(), dicts, settings, str(w1), "ds", 2)
    assert res["images"]["i0"]["boxes"] == [[1, 2, 3, 4]]  # same fingerprint: resumed
    assert set(res["images"]) == {"i0", "i1", "i2"}
    # the same partial file under other weights or another τ is not merged
    for weights, s in ((w2, settings), (w1, CamSettings(tau=0.7, min_area=1, max_area=H * W,
                                                        canonical_size=(H, W)))):
        with open(out + ".partial.jsonl", "w") as f:
            f.write(json.dumps({"fingerprint": fingerprint(str(w1), settings, "ds", dicts)})
                    + "\n")
            f.write(json.dumps(fake) + "\n")
        res = write_cam_boxes(out, model, _FakeMapper(), dicts, s, str(weights), "ds", 2)
        assert res["images"]["i0"]["boxes"] != [[1, 2, 3, 4]]
        assert res["meta"]["fingerprint"]["weights_sha256"] != "" and not os.path.exists(
            out + ".partial.jsonl")
    assert "starting fresh" in caplog.text


def test_cam_layer_experiment_runs_through_main(synthetic_root, tmp_path, load_tool):
    """benchmarks/experiment_cam_layers.py (the README's GradCAM table) on a tiny classifier."""
    from braixdet.config import build_cfg
    from braixdet.utils.checkpoint import export_model_only

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    experiment_cam_layers = load_tool("experiment_cam_layers", folder="benchmarks")

    config = os.path.join(repo, "configs", "demo", "MVCCL", "mvccl.yaml")
    opts = ["DATASETS.BRAIXDET.ROOT", synthetic_root.root, "DATASETS.BRAIXDET.PROTOCOL", "full",
            "OUTPUT_DIR", str(tmp_path / "o"), "INPUT.BRAIXDET.CACHE_DIR", str(tmp_path / "c"),
            "INPUT.BRAIXDET.CANONICAL_SIZE", "(128, 64)", "MODEL.BRAIXDET.PRETRAINED", ""]
    weights = str(tmp_path / "w.pth")
    export_model_only(build_model(build_cfg(config, opts)), weights)
    out = tmp_path / "table.md"
    experiment_cam_layers.main(["--config-file", config, "--weights", weights, "--datasets",
                                "cbis_ddsm_test", "--variants", "gradcam:res5",
                                f"layercam:{FUSED_LAYERS}", "--view-agreement", "0.1",
                                "--out", str(out), *opts])
    table = out.read_text()
    assert "| gradcam res5 |" in table and "| layercam res3+res4+res5 |" in table
    assert "| gradcam res5, view agreement δ=0.1 |" in table
    # header + one row per (method, layer), each also after the filter
    assert table.count("\n| ") == 1 + 2 * 2
    # every lesion lands in exactly one size bucket
    lesions = sum(len(known_lesions(d)) for d in DatasetCatalog.get("cbis_ddsm_test")
                  if d["label"] == 1 and d.get("annotations"))
    row = next(r for r in table.splitlines() if r.startswith("| gradcam res5 |"))
    counts = [int(c.split("(")[1].rstrip(") ")) for c in row.split("|")[3:6]]
    assert sum(counts) == lesions > 0
