"""BRAIxMVCCL multi-view classifier (stage 1, paper eq. 1; docs/DESIGN.md §3.4)."""
from typing import Dict, List

import torch
import torch.nn.functional as F
from detectron2.config import configurable
from detectron2.modeling import META_ARCH_REGISTRY
from detectron2.structures import ImageList
from torch import nn

from .backbone import (
    FUSE_FEATURE,
    MultiViewBottomUp,
    build_multiview_bottom_up,
    max_mean_pool,
)
from .gcm import GlobalConsistencyModule

__all__ = ["MVCCLClassifier", "build_image_head"]


def build_image_head(cfg, in_dim: int) -> nn.Module:
    """The malignancy head: a view summary of ``in_dim`` -> one logit. The classifier's head,
    and the detector's image head (MODEL.BRAIXDET.DET_IMAGE_LOSS_WEIGHT), which starts from it
    where the input is the same."""
    b = cfg.MODEL.BRAIXDET
    return nn.Sequential(
        nn.Linear(in_dim, b.CLS_HIDDEN_DIM), nn.ReLU(inplace=True),
        nn.Dropout(b.CLS_DROPOUT), nn.Linear(b.CLS_HIDDEN_DIM, 1),
    )


@META_ARCH_REGISTRY.register()
class MVCCLClassifier(nn.Module):
    """Two views -> one malignancy logit for the main view.

    Head input: concat[GCM global g_m + P(g_a), GAP(ũ_m), GAP(ũ_a)] (multi-view) or
    concat[GMP(u_m), GAP(u_m)] (single view: the same head without the second view), or
    concat[GMP(ũ_m), GAP(ũ_m)] with ``head_reads_aux`` False (the second view via the LCM only).
    """

    @configurable
    def __init__(
        self, *, bottom_up: MultiViewBottomUp, gcm: GlobalConsistencyModule = None,
        head: nn.Module, pixel_mean, pixel_std, multi_view: bool = True,
        consistency_weight: float = 1.0, head_reads_aux: bool = True,
    ):
        super().__init__()
        self.bottom_up = bottom_up
        self.gcm = gcm
        self.head = head
        self.multi_view = multi_view
        self.consistency_weight = consistency_weight
        self.head_reads_aux = head_reads_aux
        self.register_buffer("pixel_mean", torch.tensor(pixel_mean).view(-1, 1, 1), False)
        self.register_buffer("pixel_std", torch.tensor(pixel_std).view(-1, 1, 1), False)

    @classmethod
    def from_config(cls, cfg):
        b = cfg.MODEL.BRAIXDET
        # the encoder also outputs the GradCAM target stage when it is not the last one; the
        # aux <- main branch only where the head reads ũ_a (an unread branch would be trained
        # by nothing and break DDP without find_unused_parameters)
        bottom_up = build_multiview_bottom_up(
            cfg, bidirectional=bool(b.CLS_HEAD_READS_AUX),
            extra_features=tuple(b.CAM.TARGET_LAYER.split("+")))
        c = bottom_up.output_shape()[FUSE_FEATURE].channels
        multi_view = bool(b.MULTI_VIEW)
        gcm = GlobalConsistencyModule(c) if multi_view and b.GCM.ENABLED else None
        # config/checks.py: CLS_HEAD_READS_AUX False only multi-view, LCM on, GCM off
        in_dim = 3 * c if multi_view and b.CLS_HEAD_READS_AUX else 2 * c
        head = build_image_head(cfg, in_dim)
        return {
            "bottom_up": bottom_up, "gcm": gcm, "head": head,
            "pixel_mean": cfg.MODEL.PIXEL_MEAN, "pixel_std": cfg.MODEL.PIXEL_STD,
            "multi_view": multi_view, "consistency_weight": b.GCM.LOSS_WEIGHT,
            "head_reads_aux": bool(b.CLS_HEAD_READS_AUX),
        }

    @property
    def device(self):
        return self.pixel_mean.device

    def preprocess_image(self, batched_inputs: List[Dict]) -> ImageList:
        """Normalise and stack [main, aux] as channels (main only when single-view)."""
        images = []
        for x in batched_inputs:
            views = [x["image"]] + ([x["aux_image"]] if self.multi_view else [])
            views = [(v.to(self.device) - self.pixel_mean) / self.pixel_std for v in views]
            images.append(torch.cat(views, dim=0))
        return ImageList.from_tensors(images, self.bottom_up.size_divisibility)

    def forward_tensor(self, x: torch.Tensor, cam_layer: str = ""):
        """x: normalised (B, 2|1, H, W) -> (logits (B,), extras).

        extras: "loss_sim" (GCM consistency, unweighted; only with GCM) and, with ``cam_layer``,
        "cam_features": the activations GradCAM differentiates: that encoder stage ("res5" is
        the last, u_m), both views stacked main first. Not the LCM output ũ_m: only the
        average-pooled branch reads it, so its gradient is the same at every position and
        misses the evidence the GCM max-pools from u_m (docs/DESIGN.md §3.5).
        """
        b = x.shape[0]
        bu = self.bottom_up
        extras = {}
        if cam_layer and not x.requires_grad:
            # the graph from the target layer to the logit must exist even when the weights
            # are frozen or the caller runs under no_grad (GradCAM enables grad itself)
            x = x.detach().requires_grad_(True)
        if self.multi_view:
            feats = bu.encode(torch.cat([x[:, :1], x[:, 1:2]], dim=0))
            u = feats[FUSE_FEATURE]
            u_m, u_a = u[:b], u[b:]
            if bu.lcm is not None:
                t_m, t_a = bu.lcm(u_m, u_a)
                t_a = u_a if t_a is None else t_a
            else:
                t_m, t_a = u_m, u_a
            if self.gcm is not None:
                g, g_m, g_a = self.gcm(u_m, u_a)
                extras["loss_sim"] = self.gcm.consistency_loss(g_m, g_a)
            else:
                g = torch.amax(t_m, dim=(2, 3))
            z = [g, t_m.mean(dim=(2, 3))]
            # CLS_HEAD_READS_AUX False: the second view only through the LCM (the GCM is off
            # then, so g is GMP(ũ_m))
            if self.head_reads_aux:
                z.append(t_a.mean(dim=(2, 3)))
            z = torch.cat(z, dim=1)
        else:
            feats = bu.encode(x[:, :1])
            t_m = feats[FUSE_FEATURE]
            z = max_mean_pool(t_m)
        if cam_layer:
            if cam_layer not in feats:
                raise ValueError(f"CAM target layer {cam_layer!r} is not an encoder output "
                                 f"({sorted(feats)}); see MODEL.BRAIXDET.CAM.TARGET_LAYER")
            extras["cam_features"] = feats[cam_layer]
        return self.head(z).squeeze(1), extras

    def forward_features(self, batched_inputs: List[Dict], layer: str = FUSE_FEATURE):
        """(activations of ``layer`` for GradCAM, main views in the first B rows; logits (B,))."""
        images = self.preprocess_image(batched_inputs)
        logits, extras = self.forward_tensor(images.tensor, cam_layer=layer)
        return extras["cam_features"], logits

    def forward(self, batched_inputs: List[Dict]):
        images = self.preprocess_image(batched_inputs)
        logits, extras = self.forward_tensor(images.tensor)
        if self.training:
            labels = torch.tensor(
                [float(x["label"]) for x in batched_inputs], device=logits.device
            )
            losses = {"loss_cls": F.binary_cross_entropy_with_logits(logits, labels)}
            if "loss_sim" in extras:
                losses["loss_consistency"] = self.consistency_weight * extras["loss_sim"]
            return losses
        probs = torch.sigmoid(logits)
        return [{"prob": p, "logit": z} for p, z in zip(probs, logits)]
