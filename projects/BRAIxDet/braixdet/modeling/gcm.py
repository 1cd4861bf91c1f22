"""Global consistency module (GCM), classifier only (docs/DESIGN.md §3.3)."""
import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GlobalConsistencyModule"]


class GlobalConsistencyModule(nn.Module):
    """g_m, g_a = global max pool of u_m, u_a; shared projection P (C -> C); g = g_m + P(g_a)."""

    def __init__(self, channels: int):
        super().__init__()
        self.proj = nn.Linear(channels, channels)  # P, shared by both directions

    @staticmethod
    def pool(u: torch.Tensor) -> torch.Tensor:
        return torch.amax(u, dim=(2, 3))

    def forward(self, u_m: torch.Tensor, u_a: torch.Tensor):
        """Returns (g, g_m, g_a) with g = g_m + P(g_a), each (B, C)."""
        g_m, g_a = self.pool(u_m), self.pool(u_a)
        return g_m + self.proj(g_a), g_m, g_a

    def consistency_loss(self, g_m: torch.Tensor, g_a: torch.Tensor) -> torch.Tensor:
        """ℓ_sim = -½[cos(g_m, P(g_a)) + cos(g_a, P(g_m))], mean over the batch."""
        cos_m = F.cosine_similarity(g_m, self.proj(g_a), dim=1)
        cos_a = F.cosine_similarity(g_a, self.proj(g_m), dim=1)
        return -0.5 * (cos_m + cos_a).mean()
