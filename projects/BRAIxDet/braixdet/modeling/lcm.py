"""Local co-occurrence module (LCM), paper §3.1: ũ_m = u_m ⊕ f_l(u_m, u_a).

No official code exists; this is a reconstruction (docs/DESIGN.md §3.2). On the stride-32 features:
1x1 projections to d channels, 2D sinusoidal position encodings added to queries and keys,
multi-head cross-attention (queries from the view being updated, keys/values from the other
view), an output projection to D' channels, concatenation with the input features and a 1x1 conv
back to the input width, so that everything downstream (classifier head, FPN) is unchanged.
"""
import math

import torch
from torch import nn

__all__ = ["CrossViewAttention", "LocalCoOccurrenceModule", "cross_view_init_std",
           "fuse_weight_parts", "fuse_weight_slices", "sine_position_encoding"]


def sine_position_encoding(h: int, w: int, dim: int, device=None, dtype=None) -> torch.Tensor:
    """DETR-style 2D sinusoidal encoding, (h*w, dim): dim/2 channels for y, dim/2 for x.

    Positions are normalised to [0, 2π] so the encoding does not depend on the input size: the
    same relative location in the two views (and at train/test sizes) gets the same code.
    """
    if dim % 4 != 0:
        raise ValueError(f"position encoding needs dim % 4 == 0, got {dim}")
    npf = dim // 2
    ys = (torch.arange(h, device=device, dtype=torch.float32) + 0.5) / h * 2 * math.pi
    xs = (torch.arange(w, device=device, dtype=torch.float32) + 0.5) / w * 2 * math.pi
    t = torch.arange(npf, device=device, dtype=torch.float32)
    t = 10000.0 ** (2 * torch.div(t, 2, rounding_mode="floor") / npf)
    py = ys[:, None] / t  # (h, npf)
    px = xs[:, None] / t  # (w, npf)
    py = torch.stack([py[:, 0::2].sin(), py[:, 1::2].cos()], dim=2).flatten(1)
    px = torch.stack([px[:, 0::2].sin(), px[:, 1::2].cos()], dim=2).flatten(1)
    pos = torch.cat(
        [py[:, None, :].expand(h, w, npf), px[None, :, :].expand(h, w, npf)], dim=2
    ).reshape(h * w, dim)
    return pos.to(dtype) if dtype is not None else pos


def cross_view_init_std(gain: float, out_dim: int) -> float:
    """Initial std of the fuse conv's weights on the D' = ``out_dim`` attention channels."""
    return gain / math.sqrt(out_dim)


def fuse_weight_slices(weight: torch.Tensor):
    """(own, cross-view) slices of the channel-in axis of a fuse conv's weight (C, C + D', ...):
    it maps back to the input width C, so its first C inputs are the view's own features."""
    c = weight.shape[0]
    return slice(0, c), slice(c, None)


def fuse_weight_parts(weight: torch.Tensor):
    """(own, cross-view) parts of a fuse conv's weight, views of it (fuse_weight_slices)."""
    own, cross = fuse_weight_slices(weight)
    return weight[:, own], weight[:, cross]


class CrossViewAttention(nn.Module):
    """One direction of the LCM: updates `u_q` (B, C, h, w) with information from `u_kv`."""

    def __init__(self, in_channels, embed_dim=128, num_heads=4, out_dim=128, dropout=0.0,
                 cross_view_init_gain=0.1):
        super().__init__()
        self.in_channels = in_channels
        self.cross_view_init_gain = cross_view_init_gain
        self.q_proj = nn.Conv2d(in_channels, embed_dim, 1)
        self.k_proj = nn.Conv2d(in_channels, embed_dim, 1)
        self.v_proj = nn.Conv2d(in_channels, embed_dim, 1)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads, dropout=dropout, batch_first=True)
        self.out_proj = nn.Linear(embed_dim, out_dim)  # f_l(u_m, u_a): D' channels
        self.fuse = nn.Conv2d(in_channels + out_dim, in_channels, 1)  # u ⊕ f_l -> C channels
        self._init_fuse()

    def _init_fuse(self):
        # Identity on the u part + small weights on the attention part: ũ starts ≈ u. Why: the
        # detector's FPN (and the classifier head) then sees the encoder's (ImageNet-initialised)
        # res5 features unchanged at the start instead of a random mixing of them, and the
        # multi-view and single-view models start from the same function. The cross-view part
        # is small but not zero, so its parameters get gradients from the first step (an exact
        # zero init would also make the second view invisible until the first update). Its
        # std is gain/sqrt(D'): LCM.CROSS_VIEW_INIT_GAIN (docs/RESULTS.md §25).
        own, cross = fuse_weight_parts(self.fuse.weight.data)
        own.zero_()
        own[:, :, 0, 0] = torch.eye(self.in_channels)
        nn.init.normal_(cross, std=cross_view_init_std(self.cross_view_init_gain, cross.shape[1]))
        nn.init.zeros_(self.fuse.bias)

    def forward(self, u_q: torch.Tensor, u_kv: torch.Tensor) -> torch.Tensor:
        b, _, h, w = u_q.shape
        hk, wk = u_kv.shape[-2:]
        q = self.q_proj(u_q).flatten(2).transpose(1, 2)  # (B, h*w, d)
        k = self.k_proj(u_kv).flatten(2).transpose(1, 2)
        v = self.v_proj(u_kv).flatten(2).transpose(1, 2)
        d = q.shape[-1]
        q = q + sine_position_encoding(h, w, d, q.device, q.dtype)
        k = k + sine_position_encoding(hk, wk, d, k.device, k.dtype)
        f, _ = self.attn(q, k, v, need_weights=False)
        f = self.out_proj(f).transpose(1, 2).reshape(b, -1, h, w)  # (B, D', h, w)
        return self.fuse(torch.cat([u_q, f], dim=1))


class LocalCoOccurrenceModule(nn.Module):
    """`to_main` (main <- aux) and, in the classifier, `to_aux` (aux <- main), on res5.

    The detector builds it with bidirectional=False: `to_aux` does not exist there, and the
    parameter names of `to_main` are identical so the detector loads the classifier's weights.
    ``finer_channels`` {encoder feature: channels}: the detector's option of a main <- aux
    attention of its own on finer stages too (`finer`, LCM.EXTRA_FEATURES), where its ROI
    pooler and RPN find small lesions (docs/RESULTS.md §25).
    """

    def __init__(
        self, in_channels, embed_dim=128, num_heads=4, out_dim=128, dropout=0.0,
        bidirectional=True, cross_view_init_gain=0.1, finer_channels=None,
    ):
        super().__init__()
        rest = (embed_dim, num_heads, out_dim, dropout, cross_view_init_gain)
        self.to_main = CrossViewAttention(in_channels, *rest)
        self.to_aux = CrossViewAttention(in_channels, *rest) if bidirectional else None
        self.finer = nn.ModuleDict({name: CrossViewAttention(c, *rest)
                                    for name, c in (finer_channels or {}).items()})

    @property
    def bidirectional(self) -> bool:
        return self.to_aux is not None

    def forward(self, u_m, u_a):
        """Returns (ũ_m, ũ_a); ũ_a is None when not bidirectional."""
        t_m = self.to_main(u_m, u_a)
        t_a = self.to_aux(u_a, u_m) if self.to_aux is not None else None
        return t_m, t_a

    @classmethod
    def from_cfg(cls, cfg, in_channels, bidirectional, finer_channels=None):
        c = cfg.MODEL.BRAIXDET.LCM
        return cls(
            in_channels, embed_dim=c.EMBED_DIM, num_heads=c.NUM_HEADS, out_dim=c.OUT_DIM,
            dropout=c.DROPOUT, bidirectional=bidirectional,
            cross_view_init_gain=c.CROSS_VIEW_INIT_GAIN, finer_channels=finer_channels,
        )
