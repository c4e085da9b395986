"""A small GPT and a byte-level corpus from the Python standard library's own source files.

Shared by scripts/demo.py and scripts/bench.py: real training gives weights and Adam moments
real statistics, which is what checkpoint compression is measured on.
"""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, heads: int, ctx: int, vocab: int = 256):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def shape_for(params: float) -> tuple[int, int, int]:
    """(width, layers, heads) for about `params` parameters (12 d^2 per layer), GPT-like
    proportions: layers near width / 64 (GPT-2 small: 768 wide, 12 layers)."""
    best = None
    for d in (128, 256, 384, 512, 768, 1024, 1536, 2048, 4096):
        layers = max(2, round(params / (12 * d * d)))
        score = abs(math.log(layers / (d / 64))) + abs(math.log(12 * d * d * layers / params))
        if best is None or score < best[0]:
            best = (score, d, layers)
    _, d, layers = best
    return d, layers, max(1, d // 64)


def stdlib_corpus(limit: int) -> torch.Tensor:
    """Up to `limit` bytes of the standard library's .py files, as byte tokens (vocab 256)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, n = [], 0
    for path in sorted(root.rglob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        out.append(data)
        n += len(data)
        if n >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(out)), dtype=torch.uint8).long()


def batch(data: torch.Tensor, ctx: int, size: int, generator: torch.Generator | None = None):
    ix = torch.randint(0, data.numel() - ctx - 1, (size,), generator=generator, device=data.device)
    offsets = torch.arange(ctx, device=data.device)
    return data[ix[:, None] + offsets], data[ix[:, None] + offsets + 1]
