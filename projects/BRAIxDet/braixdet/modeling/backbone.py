"""timm encoder as a detectron2 Backbone, the two-view bottom-up and the FPN builder."""
import logging
import math

import timm
import torch
from detectron2.layers import ShapeSpec
from detectron2.modeling import BACKBONE_REGISTRY, Backbone
from detectron2.modeling.backbone.fpn import FPN, LastLevelMaxPool
from torch import nn

from .lcm import LocalCoOccurrenceModule
from .pretrained import check_pixel_normalization, create_pretrained

__all__ = [
    "TimmBackbone",
    "MultiViewBottomUp",
    "build_multiview_bottom_up",
    "max_mean_pool",
    "build_timm_backbone",
    "build_braixdet_fpn_backbone",
    "AuxGlobalFPN",
]

logger = logging.getLogger(__name__)
FUSE_FEATURE = "res5"  # the LCM works on the stride-32 features
# the bottom-up's extra output with DET_READS_AUX_GLOBAL: [max, mean] of the aux view's res5
AUX_GLOBAL = "aux_global"


def max_mean_pool(u: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) -> (B, 2C): [global max, global mean] over positions, the summary the
    classifier head reads of a view (and the detector's AUX_GLOBAL)."""
    return torch.cat([torch.amax(u, dim=(2, 3)), u.mean(dim=(2, 3))], dim=1)


class TimmBackbone(Backbone):
    """A timm `features_only` model for grey images; outputs res2..res5 (strides 4..32)."""

    def __init__(self, model_name="efficientnet_b0", out_features=("res3", "res4", "res5"),
                 pretrained="", in_chans=1, grad_checkpointing=False, channels_last=False):
        super().__init__()
        # Probe the stage layout on the meta device (no memory, no download) to pick out_indices.
        with torch.device("meta"):
            probe = timm.create_model(model_name, features_only=True, in_chans=in_chans)
        name_to_idx = {}
        for i, r in enumerate(probe.feature_info.reduction()):
            stage = int(round(math.log2(r)))
            if 2**stage == r and stage >= 2:
                name_to_idx[f"res{stage}"] = i  # later index wins: the stage's last block
        missing = [f for f in out_features if f not in name_to_idx]
        if missing:
            raise ValueError(f"{model_name} has no features {missing}; has {sorted(name_to_idx)}")
        out_features = sorted(out_features, key=lambda f: int(f[3:]))
        indices = tuple(name_to_idx[f] for f in out_features)
        del probe
        self.body = create_pretrained(model_name, pretrained, features_only=True,
                                      in_chans=in_chans, out_indices=indices)
        if grad_checkpointing:
            self.body.set_grad_checkpointing(True)
        if channels_last:
            # NHWC weights make every convolution (and so every activation after the stem) run
            # channels-last; a 1-channel input cannot carry the layout itself
            self.body.to(memory_format=torch.channels_last)
        info = self.body.feature_info
        self._out_features = list(out_features)
        self._out_feature_channels = dict(zip(out_features, info.channels()))
        self._out_feature_strides = dict(zip(out_features, info.reduction()))

    @property
    def size_divisibility(self) -> int:
        return 32

    def forward(self, x: torch.Tensor) -> dict:
        return dict(zip(self._out_features, self.body(x)))


class MultiViewBottomUp(Backbone):
    """Shared encoder on [main, aux] + LCM fusion of the main view's stride-32 features.

    forward(x): x (B, 2, H, W) = [main, aux] channels, or (B, 1, H, W) single view (a multi-view
    model then uses the main as its own aux, like a missing aux view), or a dict of
    precomputed (fused) features returned as is, so detectron2's FPN.forward can be reused on
    features computed once per exam (see MultiViewRCNN.inference_exam). With ``aux_global``
    the output also holds AUX_GLOBAL, the aux view's global summary (AuxGlobalFPN).
    """

    def __init__(self, encoder: TimmBackbone, lcm: LocalCoOccurrenceModule = None,
                 multi_view: bool = True, aux_global: bool = False):
        super().__init__()
        self.encoder = encoder
        self.lcm = lcm
        self.multi_view = multi_view
        self.aux_global = aux_global
        if lcm is not None and FUSE_FEATURE not in encoder._out_features:
            raise ValueError(f"the LCM needs encoder feature {FUSE_FEATURE}")

    @property
    def size_divisibility(self) -> int:
        return self.encoder.size_divisibility

    def output_shape(self):
        return self.encoder.output_shape()

    def encode(self, x: torch.Tensor) -> dict:
        """(N, 1, H, W) -> per-image encoder features (no fusion)."""
        return self.encoder(x)

    def fuse(self, main_feats: dict, aux_feats: dict) -> dict:
        """Main features with res5 replaced by ũ_m = LCM.to_main(u_m, u_a), and each of the
        LCM's finer stages by its own attention (LCM.EXTRA_FEATURES); others unchanged; plus
        AUX_GLOBAL with ``aux_global``."""
        out = dict(main_feats)
        if self.aux_global:
            out[AUX_GLOBAL] = max_mean_pool(aux_feats[FUSE_FEATURE])
        if self.lcm is not None:
            out[FUSE_FEATURE] = self.lcm.to_main(main_feats[FUSE_FEATURE], aux_feats[FUSE_FEATURE])
            for name, attention in self.lcm.finer.items():
                out[name] = attention(main_feats[name], aux_feats[name])
        return out

    def forward(self, x):
        if isinstance(x, dict):
            return x
        if x.dim() != 4 or x.shape[1] not in (1, 2):
            raise ValueError(f"expected (B, 1|2, H, W) input, got {tuple(x.shape)}")
        if not self.multi_view or (self.lcm is None and not self.aux_global):
            return self.encode(x[:, :1])  # single view (or no fusion): aux not needed
        if x.shape[1] == 1:
            x = x.expand(-1, 2, -1, -1)  # no aux given: the main is its own aux (docs/DESIGN.md §2)
        b = x.shape[0]
        # Both views in ONE encoder call: shared weights, one pass, batch statistics over both.
        feats = self.encode(torch.cat([x[:, :1], x[:, 1:2]], dim=0))
        main = {k: v[:b] for k, v in feats.items()}
        aux = {k: v[b:] for k, v in feats.items()}
        return self.fuse(main, aux)


def encoder_init(cfg) -> str:
    """The PRETRAINED value to build the encoder with: none when a checkpoint of this project
    (MODEL.WEIGHTS, or INIT_FROM_CLASSIFIER for the detector) overwrites the encoder anyway, so
    inference and stage 2 never need the hub. The normalisation is checked in every case: the
    checkpoint was trained with it."""
    b = cfg.MODEL.BRAIXDET
    check_pixel_normalization(cfg)
    superseded = cfg.MODEL.WEIGHTS or (b.INIT_FROM_CLASSIFIER
                                       and cfg.MODEL.META_ARCHITECTURE != "MVCCLClassifier")
    return "" if superseded else b.PRETRAINED


def _encoder_from_cfg(cfg, extra_features=()) -> TimmBackbone:
    b = cfg.MODEL.BRAIXDET
    features = tuple(dict.fromkeys([*b.OUT_FEATURES, *extra_features]))
    return TimmBackbone(
        b.TIMM_MODEL, out_features=features, pretrained=encoder_init(cfg), in_chans=b.IN_CHANS,
        grad_checkpointing=b.GRAD_CHECKPOINTING, channels_last=b.CHANNELS_LAST,
    )


def build_multiview_bottom_up(cfg, bidirectional: bool = False, extra_features=(),
                              aux_global: bool = False) -> MultiViewBottomUp:
    """Encoder + LCM (bidirectional in the classifier whose head reads ũ_a, else main branch only).
    ``extra_features``: encoder stages to output besides OUT_FEATURES (same weights);
    ``aux_global``: also output AUX_GLOBAL (the detector's DET_READS_AUX_GLOBAL)."""
    b = cfg.MODEL.BRAIXDET
    encoder = _encoder_from_cfg(cfg, extra_features)
    lcm = None
    if b.MULTI_VIEW and b.LCM.ENABLED:
        shapes = encoder.output_shape()
        # config/checks.py: detector only, each one of OUT_FEATURES
        finer = {name: shapes[name].channels for name in b.LCM.EXTRA_FEATURES}
        lcm = LocalCoOccurrenceModule.from_cfg(cfg, shapes[FUSE_FEATURE].channels,
                                               bidirectional=bidirectional, finer_channels=finer)
    return MultiViewBottomUp(encoder, lcm, multi_view=b.MULTI_VIEW, aux_global=aux_global)


@BACKBONE_REGISTRY.register()
def build_timm_backbone(cfg, input_shape: ShapeSpec = None) -> TimmBackbone:
    """Plain single-view timm backbone (no FPN)."""
    return _encoder_from_cfg(cfg)


class AuxGlobalFPN(FPN):
    """detectron2's FPN whose every output level gets, added at every position, a linear map
    of the aux view's global summary (the bottom-up's AUX_GLOBAL): the path through which the
    BRAIxMVCCL head reads its second view (an average of the aux features), which the
    detector's LCM alone does not give it (docs/RESULTS.md §25-§26). The map starts at zero,
    so the detector starts as the one without it."""

    def __init__(self, *, aux_channels: int, **kwargs):
        super().__init__(**kwargs)
        self.aux_global_proj = nn.Linear(2 * aux_channels, kwargs["out_channels"])
        nn.init.zeros_(self.aux_global_proj.weight)
        nn.init.zeros_(self.aux_global_proj.bias)

    def forward(self, x):
        feats = self.bottom_up(x)  # a dict passes through the bottom-up as is
        out = super().forward(feats)
        shift = self.aux_global_proj(feats[AUX_GLOBAL])[:, :, None, None]
        return {name: level + shift for name, level in out.items()}


@BACKBONE_REGISTRY.register()
def build_braixdet_fpn_backbone(cfg, input_shape: ShapeSpec = None) -> FPN:
    """detectron2 FPN over the two-view bottom-up (+ max-pool level on the coarsest output);
    AuxGlobalFPN with MODEL.BRAIXDET.DET_READS_AUX_GLOBAL (config/checks.py: multi-view)."""
    aux_global = bool(cfg.MODEL.BRAIXDET.DET_READS_AUX_GLOBAL)
    bottom_up = build_multiview_bottom_up(cfg, bidirectional=False, aux_global=aux_global)
    kwargs = dict(bottom_up=bottom_up, in_features=cfg.MODEL.FPN.IN_FEATURES,
                  out_channels=cfg.MODEL.FPN.OUT_CHANNELS, norm=cfg.MODEL.FPN.NORM,
                  top_block=LastLevelMaxPool(), fuse_type=cfg.MODEL.FPN.FUSE_TYPE)
    if aux_global:
        return AuxGlobalFPN(aux_channels=bottom_up.output_shape()[FUSE_FEATURE].channels,
                            **kwargs)
    return FPN(**kwargs)
