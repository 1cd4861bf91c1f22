"""Backbone, LCM, GCM, MVCCL classifier and MultiViewRCNN on tiny random-init models."""
import numpy as np
import pytest
import torch
from _cfg_helpers import tiny_cfg
from detectron2.data.transforms import ResizeTransform, TransformList
from detectron2.modeling import build_model
from detectron2.structures import Boxes, Instances
from detectron2.utils.events import EventStorage

import braixdet.modeling  # noqa: F401  (registers backbones / meta-archs)
from braixdet.modeling import (
    GlobalConsistencyModule,
    LocalCoOccurrenceModule,
    MultiViewBottomUp,
    load_classifier_weights,
    load_classifier_weights_from_cfg,
)
from braixdet.modeling.backbone import AuxGlobalFPN, build_braixdet_fpn_backbone

H, W = 128, 64


def blob_image(g, h=H, w=W):
    """Noise + one bright Gaussian blob (structured, unlike pure noise, so views differ)."""
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    cy = torch.randint(12, h - 12, (1,), generator=g).item()
    cx = torch.randint(8, w - 8, (1,), generator=g).item()
    r = 3 + 8 * torch.rand(1, generator=g).item()
    img = 0.3 * torch.rand(h, w, generator=g) + 0.7 * torch.exp(
        -((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r)
    )
    return img[None].float()


def make_inputs(n, seed=0, boxes=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        d = {"image": blob_image(g), "aux_image": blob_image(g), "label": i % 2,
             "height": H, "width": W}
        if boxes:
            d["instances"] = Instances(
                (H, W), gt_boxes=Boxes(torch.tensor([[10.0, 20.0, 40.0, 60.0]])),
                gt_classes=torch.tensor([0]),
            )
        out.append(d)
    return out


@torch.no_grad()
def calibrate_bn(model, inputs):
    """Random-init timm nets collapse in eval mode (running stats 0/1). One train-mode forward
    with cumulative BN averaging sets the running stats to these inputs' batch statistics, so
    eval-mode outputs depend on the input."""
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    saved = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    x = model.preprocess_image(inputs).tensor
    model.forward_tensor(x) if hasattr(model, "forward_tensor") else model.backbone(x)
    for m, mom in zip(bns, saved):
        m.momentum = mom
    model.eval()
    return model


def configured(meta="MultiViewRCNN", multi_view=True, **overrides):
    """tiny_cfg with full-key overrides such as **{"MODEL.BRAIXDET.MULTI_VIEW": False}."""
    cfg = tiny_cfg(meta, multi_view=multi_view)
    for k, v in overrides.items():
        node = cfg
        *parents, leaf = k.split(".")
        for p in parents:
            node = getattr(node, p)
        setattr(node, leaf, v)
    return cfg


def build(meta="MultiViewRCNN", multi_view=True, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = configured(meta, multi_view, **overrides)
    return build_model(cfg), cfg


# --- backbone ---------------------------------------------------------------------------------

def test_backbone_shapes():
    cfg = tiny_cfg()
    cfg.MODEL.BRAIXDET.OUT_FEATURES = ["res2", "res3", "res4", "res5"]
    fpn = build_braixdet_fpn_backbone(cfg)
    bu = fpn.bottom_up
    assert isinstance(bu, MultiViewBottomUp) and bu.lcm is not None and bu.lcm.to_aux is None
    shapes = bu.output_shape()
    assert {k: s.stride for k, s in shapes.items()} == {"res2": 4, "res3": 8, "res4": 16,
                                                         "res5": 32}
    assert bu.size_divisibility == 32
    x = torch.rand(1, 2, H, W)
    feats = bu(x)
    for k, s in shapes.items():
        assert feats[k].shape == (1, s.channels, H // s.stride, W // s.stride)
    # the dict passthrough lets FPN.forward run on precomputed features
    assert bu(feats) is feats
    out = fpn(feats)
    assert list(out) == ["p3", "p4", "p5", "p6"]
    assert out["p6"].shape == (1, 32, H // 64, W // 64)
    # single-channel input: the main view is its own aux (missing-aux convention)
    bu.eval()
    same = torch.cat([x[:, :1], x[:, :1]], dim=1)
    assert torch.allclose(bu(x[:, :1])["res5"], bu(same)["res5"], atol=1e-6)


def test_lcm_identity_init_and_uses_aux():
    torch.manual_seed(0)
    lcm = LocalCoOccurrenceModule(16, embed_dim=32, num_heads=4, out_dim=8, bidirectional=True)
    u_m, u_a = torch.randn(2, 16, 4, 2), torch.randn(2, 16, 4, 2)
    t_m, t_a = lcm(u_m, u_a)
    assert t_m.shape == u_m.shape and t_a.shape == u_a.shape
    # starts close to u_m (identity-initialised fusion) but does depend on the aux view
    rel = (t_m - u_m).norm() / u_m.norm()
    assert 1e-4 < rel < 0.3
    t_m2, _ = lcm(u_m, torch.randn(2, 16, 4, 2))
    assert not torch.allclose(t_m, t_m2)
    assert LocalCoOccurrenceModule(16, 32, 4, 8, bidirectional=False).to_aux is None


@pytest.mark.parametrize("gain", [0.1, 1.0])
def test_lcm_cross_view_init_gain_from_config(gain):
    """LCM.CROSS_VIEW_INIT_GAIN sets the std of the fuse conv's cross-view weights to
    gain/sqrt(D') (both directions); the own-feature part stays the identity."""
    model, cfg = build("MVCCLClassifier", **{"MODEL.BRAIXDET.LCM.CROSS_VIEW_INIT_GAIN": gain,
                                            "MODEL.BRAIXDET.LCM.OUT_DIM": 256})
    for cva in (model.bottom_up.lcm.to_main, model.bottom_up.lcm.to_aux):
        w, c = cva.fuse.weight[:, :, 0, 0], cva.in_channels
        assert torch.equal(w[:, :c], torch.eye(c))
        assert w[:, c:].std().item() == pytest.approx(gain / 256 ** 0.5, rel=0.05)


def test_lcm_lr_factor_scales_only_the_lcm():
    """LCM.LR_FACTOR: the optimizer gives every LCM parameter BASE_LR * factor, every other
    parameter the lr it had without the option, and each parameter sits in exactly one group."""
    from braixdet.engine.trainers import BRAIxDetTrainer

    model, cfg = build()
    base = {id(p): g["lr"] for g in BRAIxDetTrainer.build_optimizer(cfg, model).param_groups
            for p in g["params"]}
    cfg.defrost()
    cfg.MODEL.BRAIXDET.LCM.LR_FACTOR = 10.0
    groups = BRAIxDetTrainer.build_optimizer(cfg, model).param_groups
    lr = {}
    for g in groups:
        for p in g["params"]:
            assert id(p) not in lr
            lr[id(p)] = g["lr"]
    lcm = {id(p) for p in model.backbone.bottom_up.lcm.parameters()}
    assert lr.keys() == base.keys() and lcm and lcm < lr.keys()
    for k, v in lr.items():
        assert v == pytest.approx(base[k] * (10.0 if k in lcm else 1.0))


def test_gcm_loss_formula():
    gcm = GlobalConsistencyModule(2)
    with torch.no_grad():
        gcm.proj.weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))  # P swaps coordinates
        gcm.proj.bias.zero_()
    g_m = torch.tensor([[1.0, 0.0], [3.0, 4.0]])
    g_a = torch.tensor([[1.0, 0.0], [4.0, 3.0]])
    # P(g_a) = [[0,1],[3,4]], P(g_m) = [[0,1],[4,3]]
    cos1 = torch.tensor([0.0, 1.0])  # cos(g_m, P g_a)
    cos2 = torch.tensor([0.0, 1.0])  # cos(g_a, P g_m)
    expected = -0.5 * (cos1 + cos2).mean()
    assert torch.allclose(gcm.consistency_loss(g_m, g_a), expected, atol=1e-6)
    u_m = torch.zeros(2, 2, 3, 3)
    u_m[:, :, 1, 1] = g_m
    u_a = torch.zeros(2, 2, 3, 3)
    u_a[:, :, 0, 2] = g_a
    g, pm, pa = gcm(u_m, u_a)  # global max pool, g = g_m + P(g_a)
    assert torch.equal(pm, g_m) and torch.equal(pa, g_a)
    assert torch.allclose(g, g_m + g_a.flip(1))


# --- classifier -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def trained_classifier():
    """MVCCL overfitted on a fixed batch of 4 (shared: training is the slow part)."""
    model, _ = build("MVCCLClassifier")
    inputs = make_inputs(4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    history = []
    for _ in range(8):
        losses = model(inputs)
        assert set(losses) == {"loss_cls", "loss_consistency"}
        opt.zero_grad()
        sum(losses.values()).backward()
        opt.step()
        history.append({k: v.item() for k, v in losses.items()})
    model.eval()
    return model, inputs, history


def test_mvccl_overfits_fixed_batch(trained_classifier):
    model, inputs, history = trained_classifier
    assert model.bottom_up.lcm.to_aux is not None and model.gcm is not None
    cls = [h["loss_cls"] for h in history]
    assert cls[-1] < 0.3 * cls[0] and cls[-1] < 0.1
    # the consistency term is optimised too (cosines -> 1, so ℓ_sim -> -1)
    assert history[-1]["loss_consistency"] < history[0]["loss_consistency"] - 0.1
    out = model(inputs)
    assert len(out) == 4 and out[0]["prob"].dim() == 0
    assert torch.allclose(out[1]["prob"], torch.sigmoid(out[1]["logit"]))


def _swap_aux(inputs):
    g = torch.Generator().manual_seed(9)
    return [dict(d, aux_image=blob_image(g)) for d in inputs]


def _fused_main_and_logits(model, inputs):
    """ũ_m (the LCM's main-view output) and the logits."""
    x = model.preprocess_image(inputs).tensor
    return model.bottom_up(x)["res5"], model.forward_tensor(x)[0]


def test_mvccl_uses_second_view(trained_classifier):
    model, inputs, _ = trained_classifier
    with torch.no_grad():
        f1, z1 = _fused_main_and_logits(model, inputs)
        f2, z2 = _fused_main_and_logits(model, _swap_aux(inputs))
    scale = f1.abs().max()
    # deterministic eval-mode difference, far above float noise (~1e-7 relative)
    assert (f1 - f2).abs().max() > 1e-5 * scale
    assert (z1 - z2).abs().max() > 1e-5
    # control: with the LCM's cross-view part switched off, the aux no longer reaches ũ_m
    fuse = model.bottom_up.lcm.to_main.fuse
    saved = fuse.weight.detach().clone()
    c = fuse.out_channels
    with torch.no_grad():
        fuse.weight[:, c:] = 0
        g1, _ = _fused_main_and_logits(model, inputs)
        g2, _ = _fused_main_and_logits(model, _swap_aux(inputs))
        fuse.weight.copy_(saved)
    assert (g1 - g2).abs().max() < 1e-6 * scale


def test_classifier_head_reading_the_aux_view_only_through_the_lcm():
    """CLS_HEAD_READS_AUX False (GCM off): the logit depends on the second view, and only
    through the LCM: with its cross-view fuse weights zeroed the aux view changes nothing."""
    from braixdet.config import ConfigValueError, check_config

    model, cfg = build("MVCCLClassifier", **{"MODEL.BRAIXDET.CLS_HEAD_READS_AUX": False,
                                            "MODEL.BRAIXDET.GCM.ENABLED": False})
    check_config(cfg)
    inputs = make_inputs(4, seed=3)
    # the aux <- main branch, which this head never reads, is not built: every parameter
    # gets a gradient (DDP's default needs that)
    assert not model.bottom_up.lcm.bidirectional
    losses = model.train()(inputs)
    sum(losses.values()).backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
    calibrate_bn(model, inputs)
    x = model.preprocess_image(inputs).tensor
    other = torch.cat([x[:, :1], x.flip(0)[:, 1:2]], dim=1)  # other images as second views
    with torch.no_grad():
        assert not torch.allclose(model.forward_tensor(x)[0], model.forward_tensor(other)[0])
        model.bottom_up.lcm.to_main.fuse.weight[:, model.bottom_up.lcm.to_main.in_channels:] = 0
        assert torch.allclose(model.forward_tensor(x)[0], model.forward_tensor(other)[0],
                              atol=1e-6)
    cfg.MODEL.BRAIXDET.GCM.ENABLED = True  # its global feature reads the aux view
    with pytest.raises(ConfigValueError, match="CLS_HEAD_READS_AUX"):
        check_config(cfg)


def test_single_view_classifier_ignores_aux():
    model, _ = build("MVCCLClassifier", multi_view=False)
    inputs = make_inputs(2, seed=1)
    assert model.gcm is None and model.bottom_up.lcm is None
    assert set(model.train()(inputs)) == {"loss_cls"}
    calibrate_bn(model, inputs)
    with torch.no_grad():
        f1, z1 = model.forward_features(inputs)
        f2, z2 = model.forward_features(_swap_aux(inputs))
    assert torch.equal(f1, f2) and torch.equal(z1, z2)


# --- detector ---------------------------------------------------------------------------------

@pytest.mark.parametrize("multi_view", [True, False])
def test_rcnn_train_step(multi_view):
    model, cfg = build(multi_view=multi_view)
    assert type(model).__name__ == "MultiViewRCNN"
    assert (model.backbone.bottom_up.lcm is not None) == multi_view
    model.train()
    with EventStorage():
        losses = model(make_inputs(2, boxes=True))
    assert set(losses) == {"loss_cls", "loss_box_reg", "loss_rpn_cls", "loss_rpn_loc"}
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    lcm = model.backbone.bottom_up.lcm
    if multi_view:
        assert lcm.to_main.attn.in_proj_weight.grad is not None


def test_lcm_extra_features_fuse_res4_in_the_detector():
    """LCM.EXTRA_FEATURES ["res4"]: the detector's res4 gets a main <- aux attention of its own
    (res4 then depends on the aux view, res3 still does not), it trains, and the classifier's
    weights load with only that attention left at its initialisation."""
    det, cfg = build(**{"MODEL.BRAIXDET.LCM.EXTRA_FEATURES": ["res4"]})
    bu = det.backbone.bottom_up
    assert list(bu.lcm.finer) == ["res4"]
    bu.eval()
    x = torch.rand(1, 2, H, W)
    other = torch.cat([x[:, :1], torch.rand(1, 1, H, W)], dim=1)
    a, b = bu(x), bu(other)
    assert not torch.allclose(a["res4"], b["res4"]) and not torch.allclose(a["res5"], b["res5"])
    assert torch.equal(a["res3"], b["res3"])
    det.train()
    with EventStorage():
        losses = det(make_inputs(2, boxes=True))
    sum(losses.values()).backward()
    assert bu.lcm.finer["res4"].attn.in_proj_weight.grad.abs().sum() > 0
    cls, _ = build("MVCCLClassifier", seed=4)
    report = load_classifier_weights(det, cls.state_dict())
    assert report["missing"] and all(".lcm.finer.res4." in k for k in report["missing"])


@pytest.mark.parametrize("meta,multi_view,extra", [
    ("MVCCLClassifier", True, ["res4"]),  # the classifier's head reads res5 alone
    ("MultiViewRCNN", False, ["res4"]),  # no LCM in a single-view detector
    ("MultiViewRCNN", True, ["res5"]),  # res5 is fused anyway
    ("MultiViewRCNN", True, ["res2"]),  # not an encoder output
])
def test_lcm_extra_features_refused_where_they_would_do_nothing(meta, multi_view, extra):
    from braixdet.config import ConfigValueError, check_config

    cfg = tiny_cfg(meta, multi_view=multi_view)
    cfg.MODEL.BRAIXDET.LCM.EXTRA_FEATURES = extra
    with pytest.raises(ConfigValueError, match="LCM.EXTRA_FEATURES"):
        check_config(cfg)


def test_det_reads_aux_global_starts_as_the_fpn_and_learns_the_aux_view():
    """DET_READS_AUX_GLOBAL: every FPN level gets a map of the aux view's [max, mean] res5,
    zero at the start (the output is detectron2's FPN's), trained from the first step, and
    then the only way the aux view reaches the features when the LCM is off."""
    from detectron2.modeling.backbone.fpn import FPN

    det, _ = build(**{"MODEL.BRAIXDET.DET_READS_AUX_GLOBAL": True,
                      "MODEL.BRAIXDET.LCM.ENABLED": False})
    fpn = det.backbone
    assert isinstance(fpn, AuxGlobalFPN)
    calibrate_bn(det, make_inputs(2))
    x = torch.rand(2, 2, H, W)
    other = torch.cat([x[:, :1], torch.rand(2, 1, H, W)], dim=1)
    with torch.no_grad():
        a, plain = fpn(x), FPN.forward(fpn, x)
        assert list(a) == list(plain) and all(torch.equal(a[k], plain[k]) for k in a)
    det.train()
    with EventStorage():
        losses = det(make_inputs(2, boxes=True))
    sum(losses.values()).backward()
    assert fpn.aux_global_proj.weight.grad.abs().sum() > 0
    det.eval()
    with torch.no_grad():
        torch.nn.init.normal_(fpn.aux_global_proj.weight, std=0.1)
        a, b = fpn(x), fpn(other)
        assert all(torch.equal(FPN.forward(fpn, x)[k], FPN.forward(fpn, other)[k]) for k in a)
        assert all(not torch.allclose(a[k], b[k]) for k in a)
        # the shift is the same at every position of a level: a global summary
        d = a["p3"] - FPN.forward(fpn, x)["p3"]
        assert torch.allclose(d, d[:, :, :1, :1].expand_as(d), atol=1e-6)


@pytest.mark.parametrize("meta,multi_view", [
    ("MVCCLClassifier", True),  # the classifier's head reads the aux view already
    ("MultiViewRCNN", False),  # a single-view detector has no aux view
])
def test_det_reads_aux_global_refused_where_it_would_do_nothing(meta, multi_view):
    from braixdet.config import ConfigValueError, check_config

    cfg = tiny_cfg(meta, multi_view=multi_view)
    cfg.MODEL.BRAIXDET.DET_READS_AUX_GLOBAL = True
    with pytest.raises(ConfigValueError, match="DET_READS_AUX_GLOBAL"):
        check_config(cfg)


def training_losses_and_grads(model):
    """One training forward + backward on fixed inputs and RPN / ROI sampling -> (losses,
    gradients by parameter name)."""
    model.train()
    torch.manual_seed(5)  # same RPN / ROI sampling
    with EventStorage():
        losses = model(make_inputs(2, boxes=True))
    sum(losses.values()).backward()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def encoder_in_layout(model, layout):
    """The encoder's convolution weights have ``layout``'s strides (1×1 and one-input-channel
    kernels are contiguous in both layouts, so ``is_contiguous`` cannot tell) and its features
    come out in ``layout``, not in the other one."""
    encoder = model.backbone.bottom_up.encoder
    other = torch.contiguous_format if layout == torch.channels_last else torch.channels_last
    weights = [p for p in encoder.parameters() if p.dim() == 4]
    with torch.no_grad():
        features = encoder(torch.rand(2, 1, H, W))["res4"]
    return (all(p.stride() == torch.empty_like(p, memory_format=layout).stride()
                for p in weights)
            and features.is_contiguous(memory_format=layout)
            and not features.is_contiguous(memory_format=other))


def test_grad_checkpointing_gives_the_same_losses_and_gradients():
    """MODEL.BRAIXDET.GRAD_CHECKPOINTING recomputes the encoder in backward (timm): same
    numbers as without it."""
    grads = []
    for ckpt in (False, True):
        model, _ = build(seed=3, **{"MODEL.BRAIXDET.GRAD_CHECKPOINTING": ckpt})
        assert model.backbone.bottom_up.encoder.body.grad_checkpointing == ckpt
        grads.append(training_losses_and_grads(model))
    (l0, g0), (l1, g1) = grads
    assert all(torch.allclose(l0[k], l1[k], atol=1e-6) for k in l0)
    assert g0.keys() == g1.keys() and all(torch.allclose(g0[k], g1[k], atol=1e-5) for k in g0)


def test_channels_last_gives_the_same_losses_and_gradients():
    """MODEL.BRAIXDET.CHANNELS_LAST runs the encoder in NHWC: its weights and features carry
    that layout (off: NCHW), and the losses and gradients are those of the NCHW model up to
    float rounding."""
    grads = []
    for channels_last in (False, True):
        model, _ = build(seed=3, **{"MODEL.BRAIXDET.CHANNELS_LAST": channels_last})
        layout = torch.channels_last if channels_last else torch.contiguous_format
        assert encoder_in_layout(model, layout)
        grads.append(training_losses_and_grads(model))
    (l0, g0), (l1, g1) = grads
    assert all(torch.allclose(l0[k], l1[k], atol=1e-5) for k in l0)
    assert g0.keys() == g1.keys()
    assert all(torch.allclose(g0[k], g1[k], rtol=1e-3, atol=1e-5) for k in g0)


def test_channels_last_survives_checkpoints_of_either_layout_and_the_teacher_copy():
    """A checkpoint saved in NCHW (releases before the switch) loads into the channels-last
    model with the same values and the model's layout, and the reverse; the EMA teacher keeps
    the student's layout."""
    from braixdet.ssl.ema import build_teacher

    nhwc, _ = build(seed=3, **{"MODEL.BRAIXDET.CHANNELS_LAST": True})
    nchw, _ = build(seed=4, **{"MODEL.BRAIXDET.CHANNELS_LAST": False})
    for dst, src, layout in ((nhwc, nchw, torch.channels_last),
                             (nchw, nhwc, torch.contiguous_format)):
        dst.load_state_dict(src.state_dict())
        assert all(torch.equal(a, b) for a, b in zip(dst.state_dict().values(),
                                                     src.state_dict().values()))
        assert encoder_in_layout(dst, layout)
    assert encoder_in_layout(build_teacher(nhwc), torch.channels_last)


def test_rcnn_inference_original_coords():
    model, _ = build()
    inputs = make_inputs(2, seed=2)
    calibrate_bn(model, inputs)
    with torch.no_grad():
        canon = model(inputs)  # height/width == canonical: no change of frame
        orig_h, orig_w = 512, 192  # original grid: scale 4 in y, 3 in x
        tfm = TransformList([ResizeTransform(orig_h, orig_w, H, W)])
        mapped = model([dict(d, transforms=tfm, height=orig_h, width=orig_w) for d in inputs])
    for c, m in zip(canon, mapped):
        c, m = c["instances"], m["instances"]
        assert len(c) > 0 and m.image_size == (orig_h, orig_w)
        scale = torch.tensor([3.0, 4.0, 3.0, 4.0])
        assert len(c) == len(m)
        assert torch.allclose(m.pred_boxes.tensor, c.pred_boxes.tensor * scale, atol=1e-3)
        assert torch.equal(m.scores, c.scores)


@pytest.mark.parametrize("aux_global", [False, True])
def test_rcnn_inference_exam_matches_per_image(aux_global):
    model, _ = build(seed=3, **{"MODEL.BRAIXDET.DET_READS_AUX_GLOBAL": aux_global})
    if aux_global:  # a trained map (it starts at zero)
        torch.nn.init.normal_(model.backbone.aux_global_proj.weight, std=0.1)
    g = torch.Generator().manual_seed(5)
    images = [blob_image(g) for _ in range(4)]  # L-CC, L-MLO, R-CC, R-MLO
    pairs = [(0, 1), (1, 0), (2, 3), (3, 2)]
    calibrate_bn(model, [{"image": images[m], "aux_image": images[a]} for m, a in pairs])
    tfms = [TransformList([ResizeTransform(2 * H, 2 * W, H, W)]) for _ in images]
    sizes = [(2 * H, 2 * W)] * 4
    with torch.no_grad():
        exam = model.inference_exam(images, pairs, transforms=tfms, sizes=sizes)
        # the usual path: one input dict per main image (pairs are independent in eval mode)
        single = model([
            {"image": images[m], "aux_image": images[a], "transforms": tfms[m],
             "height": 2 * H, "width": 2 * W}
            for m, a in pairs
        ])
    assert len(exam) == 4
    for e, s in zip(exam, single):
        e, s = e["instances"], s["instances"]
        assert len(e) == len(s) > 0
        assert torch.allclose(e.scores, s.scores, atol=1e-5)
        assert torch.allclose(e.pred_boxes.tensor, s.pred_boxes.tensor, atol=1e-3)
    # pairs really differ (the aux view enters through the LCM)
    assert not torch.allclose(exam[0]["instances"].scores, exam[2]["instances"].scores)


def test_load_classifier_weights(tmp_path):
    cls, _ = build("MVCCLClassifier", seed=4)
    det, cfg = build(seed=5)
    report = load_classifier_weights(det, cls.state_dict())
    det_sd = det.state_dict()
    expected = {k for k in det_sd if k.startswith("backbone.bottom_up.")}
    assert set(report["loaded"]) == expected and not report["missing"]
    assert not report["mismatched"]
    assert any(k.startswith("bottom_up.lcm.to_aux.") for k in report["dropped"])
    assert any(k.startswith("gcm.") for k in report["dropped"])
    assert any(k.startswith("head.") for k in report["dropped"])
    assert all(k.startswith(("bottom_up.lcm.to_aux.", "gcm.", "head.")) for k in report["dropped"])
    cls_sd = cls.state_dict()
    for k in expected:  # values (incl. BN running stats) really copied
        assert torch.equal(det_sd[k], cls_sd[k[len("backbone."):]])

    # from cfg: a detectron2-style checkpoint {"model": state_dict, ...}
    det2, _ = build(seed=6)
    path = tmp_path / "model_final.pth"
    torch.save({"model": cls_sd, "iteration": 10}, path)
    cfg.MODEL.BRAIXDET.INIT_FROM_CLASSIFIER = str(path)
    rep2 = load_classifier_weights_from_cfg(det2, cfg)
    assert set(rep2["loaded"]) == expected
    w = "backbone.bottom_up.lcm.to_main.fuse.weight"
    assert torch.equal(det2.state_dict()[w], cls_sd[w[len("backbone."):]])

    # single-view detector: the classifier's LCM has nowhere to go, the encoder still loads
    det_sv, _ = build(multi_view=False, seed=7)
    rep3 = load_classifier_weights(det_sv, cls_sd)
    assert not rep3["missing"] and any(".to_main." in k for k in rep3["dropped"])


def test_single_view_rcnn_ignores_aux():
    model, _ = build(multi_view=False, seed=8)
    inputs = make_inputs(1, seed=3)
    calibrate_bn(model, inputs)
    other = [dict(inputs[0], aux_image=torch.zeros(1, H, W))]
    with torch.no_grad():
        a, b = model(inputs)[0]["instances"], model(other)[0]["instances"]
    assert torch.equal(a.scores, b.scores) and np.array_equal(
        a.pred_boxes.tensor.numpy(), b.pred_boxes.tensor.numpy())


# --- image-level loss in the detector (MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT) ------------------

_H_CLASSIFIER = {"MODEL.BRAIXDET.CLS_HEAD_READS_AUX": False, "MODEL.BRAIXDET.GCM.ENABLED": False}


def test_det_image_loss_is_the_bce_of_the_fused_res5_and_trains_the_lcm():
    """The detector's image loss is w * BCE(head([max, mean] of ũ_m), label), and alone it
    sends a gradient into the LCM's cross-view path; without the option there is no such
    term and no head."""
    plain, _ = build(seed=1)
    assert plain.image_head is None
    plain.train()
    with EventStorage():
        assert "loss_image" not in plain(make_inputs(2, boxes=True))
    det, _ = build(seed=1, **{"MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT": 0.5})
    det.train()
    inputs = make_inputs(4, boxes=True)
    torch.manual_seed(2)
    with EventStorage():
        losses = det(inputs)
    x = det.preprocess_image(inputs).tensor
    u = det.backbone.bottom_up(x)["res5"]  # train mode: same batch statistics as in forward
    z = det.image_head(torch.cat([u.amax(dim=(2, 3)), u.mean(dim=(2, 3))], dim=1)).squeeze(1)
    want = 0.5 * torch.nn.functional.binary_cross_entropy_with_logits(
        z, torch.tensor([float(d["label"]) for d in inputs]))
    assert torch.allclose(losses["loss_image"], want, atol=1e-6)
    det.zero_grad()
    losses["loss_image"].backward()
    fuse = det.backbone.bottom_up.lcm.to_main
    grads = [p.grad for n, p in fuse.named_parameters() if p.grad is not None]
    assert grads and sum(g.abs().sum() for g in grads) > 0
    assert all(p.grad is None or p.grad.abs().sum() == 0
               for p in det.roi_heads.parameters())  # the image loss is the head's alone


@pytest.mark.parametrize("cls_overrides,multi_view,loads", [
    (_H_CLASSIFIER, True, True),  # head reads [max, mean] of ũ_m, as the detector's does
    ({}, False, True),  # single view: [max, mean] of u_m
    ({}, True, False),  # the paper's head reads 3C (GCM, ũ_m, ũ_a): not the same input
])
def test_det_image_head_starts_as_the_classifiers_head(cls_overrides, multi_view, loads):
    """Where the classifier's head reads the summary the detector's reads, the detector's
    image logit equals the classifier's logit on the same views; otherwise the head stays
    fresh, whole, and nothing is reported mismatched."""
    cls, _ = build("MVCCLClassifier", multi_view=multi_view, seed=4, **cls_overrides)
    inputs = make_inputs(3, seed=5)
    calibrate_bn(cls, inputs)
    det, _ = build(multi_view=multi_view, seed=6, **{"MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT": 1.0})
    fresh = {k: v.clone() for k, v in det.image_head.state_dict().items()}
    report = load_classifier_weights(det, cls.state_dict())
    assert report["mismatched"] == []
    det.eval()
    with torch.no_grad():
        got = det.image_logits(det.backbone.bottom_up(det.preprocess_image(inputs).tensor))
        want = torch.stack([o["logit"] for o in cls(inputs)])
    head = det.image_head.state_dict()
    if loads:
        assert torch.allclose(got, want, atol=1e-5)
        assert all(f"image_head.{k}" in report["loaded"] for k in cls.head.state_dict())
    else:
        assert all(torch.equal(head[k], fresh[k]) for k in head)
        assert not any(k.startswith("image_head") for k in report["loaded"])


def test_image_score_gate_scales_each_box_by_its_images_probability():
    """TEST.BRAIXDET.IMAGE_SCORE_GATE: the same boxes, each score × sigmoid(image logit), in
    the per-image path and in ExamPredictor's inference_exam alike."""
    det, _ = build(seed=3, **{"MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT": 1.0})
    torch.nn.init.normal_(det.image_head[-1].weight, std=1.0)  # probabilities far from 0.5
    g = torch.Generator().manual_seed(5)
    images = [blob_image(g) for _ in range(4)]
    pairs = [(0, 1), (1, 0), (2, 3), (3, 2)]
    inputs = [{"image": images[m], "aux_image": images[a]} for m, a in pairs]
    calibrate_bn(det, inputs)
    with torch.no_grad():
        plain = det(inputs)
        probs = torch.sigmoid(det.image_logits(
            det.backbone.bottom_up(det.preprocess_image(inputs).tensor)))
        det.image_score_gate = True
        gated = det(inputs)
        exam = det.inference_exam(images, pairs)
    assert not torch.allclose(probs, torch.full_like(probs, probs[0]))
    for p, a, b, e in zip(probs, plain, gated, exam):
        a, b, e = a["instances"], b["instances"], e["instances"]
        assert len(a) > 0 and torch.equal(a.pred_boxes.tensor, b.pred_boxes.tensor)
        assert torch.allclose(b.scores, a.scores * p, atol=1e-6)
        assert torch.allclose(e.scores, b.scores, atol=1e-5)
    det.train()  # the SSL teacher's pseudo-labels (do_postprocess False) read unscaled scores
    det.eval()
    with torch.no_grad():
        raw = det.inference(inputs, do_postprocess=False)
    assert all(torch.equal(r.scores, a["instances"].scores) for r, a in zip(raw, plain))


@pytest.mark.parametrize("key,value,overrides", [
    ("MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT", 1.0, {"meta": "MVCCLClassifier"}),
    ("MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT", 1.0, {"SSL.SOFT_TEACHER": True}),
    ("MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT", -0.5, {}),
    ("TEST.BRAIXDET.IMAGE_SCORE_GATE", True, {}),  # no image head to gate by
])
def test_det_image_loss_refused_where_it_would_do_nothing(key, value, overrides):
    from braixdet.config import ConfigValueError, check_config

    cfg = configured(**{key: value, **overrides})
    with pytest.raises(ConfigValueError, match=key.split(".")[-1]):
        check_config(cfg)


def test_det_image_head_of_another_width_is_refused_not_trained_from_scratch(tmp_path):
    """A classifier head that reads the detector's summary at another CLS_HIDDEN_DIM (the
    demo's classifier has 128, a detector config the default 256) would load nothing and leave
    the image head untrained; starting the detector says so in one line instead."""
    cls, _ = build("MVCCLClassifier", seed=4, **_H_CLASSIFIER,
                   **{"MODEL.BRAIXDET.CLS_HIDDEN_DIM": 16})
    path = tmp_path / "classifier.pth"
    torch.save({"model": cls.state_dict()}, path)
    det, cfg = build(seed=6, **{"MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT": 1.0,
                                "MODEL.BRAIXDET.INIT_FROM_CLASSIFIER": str(path)})
    with pytest.raises(ValueError, match="image head .*CLS_HIDDEN_DIM to the classifier's"):
        load_classifier_weights_from_cfg(det, cfg)
    cfg.MODEL.BRAIXDET.CLS_HIDDEN_DIM = 16
    det = build_model(cfg)
    report = load_classifier_weights_from_cfg(det, cfg)
    assert "image_head.0.weight" in report["loaded"]
    assert torch.equal(det.image_head[0].weight, cls.head[0].weight)
