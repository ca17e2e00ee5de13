"""A shifted-window attention block as timm's Swin writes it, exported to ONNX once per test process."""

from functools import lru_cache

import torch
from torch import nn

DIM, HEADS, WINDOW, SHIFT, SIDE, BATCH = 32, 2, 7, 3, 14, 2
N = WINDOW * WINDOW


def _shift_mask() -> torch.Tensor:
    """Swin's mask of the shifted windows [nW, N, N]: -100 between tokens that came from different regions."""
    regions = torch.zeros(1, SIDE, SIDE, 1)
    cuts = (slice(0, -WINDOW), slice(-WINDOW, -SHIFT), slice(-SHIFT, None))
    for i, (h, w) in enumerate((h, w) for h in cuts for w in cuts):
        regions[:, h, w, :] = i
    r = regions.view(1, SIDE // WINDOW, WINDOW, SIDE // WINDOW, WINDOW, 1).permute(0, 1, 3, 2, 4, 5).reshape(-1, N)
    return (r.unsqueeze(1) - r.unsqueeze(2)).ne(0).float() * -100.0


class SwinBlock(nn.Module):
    """LayerNorm, roll, window partition, attention with relative position bias (+ the shift mask), window merge,
    roll back, residual: x [B, SIDE, SIDE, DIM] -> same."""

    def __init__(self, shift: int):
        super().__init__()
        self.shift = shift
        self.norm = nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.bias = nn.Parameter(torch.randn(1, HEADS, N, N))
        self.register_buffer("mask", _shift_mask() if shift else None)

    def forward(self, x):
        b, h, w, c = x.shape
        s = self.norm(x)
        if self.shift:
            s = torch.roll(s, (-self.shift, -self.shift), (1, 2))
        win = s.view(b, h // WINDOW, WINDOW, w // WINDOW, WINDOW, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, N, c)
        q, k, v = self.qkv(win).reshape(-1, N, 3, HEADS, c // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        a = (q * (c // HEADS) ** -0.5) @ k.transpose(-2, -1) + self.bias
        if self.mask is not None:
            nw = self.mask.shape[0]
            a = (a.view(-1, nw, HEADS, N, N) + self.mask.unsqueeze(1).unsqueeze(0)).view(-1, HEADS, N, N)
        o = (a.softmax(-1) @ v).transpose(1, 2).reshape(-1, N, c)
        o = self.proj(o).view(b, h // WINDOW, w // WINDOW, WINDOW, WINDOW, c).permute(0, 1, 3, 2, 4, 5)
        o = o.reshape(b, h, w, c)
        if self.shift:
            o = torch.roll(o, (self.shift, self.shift), (1, 2))
        return x + o


class TwoBlocks(nn.Module):
    """A window block, then a shifted one (Swin's pair)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(SwinBlock(0), SwinBlock(SHIFT))

    def forward(self, x):
        return self.blocks(x)


@lru_cache(maxsize=1)
def exported():
    """(module, example input, ONNX model)."""
    import kiln

    torch.manual_seed(0)
    module = TwoBlocks().eval()
    x = torch.randn(BATCH, SIDE, SIDE, DIM)
    model, _ = kiln.from_torch(module, (x,))
    return module, x, model
