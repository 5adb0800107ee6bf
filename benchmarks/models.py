"""The benchmark model: a decoder-only transformer built from torch's own layers, and its data."""

from __future__ import annotations

import torch
from torch import nn


class DecoderLayer(nn.TransformerEncoderLayer):
    """A pre-norm transformer block; the benchmark's FSDP unit."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__(d_model, heads, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True, norm_first=True)


class Decoder(nn.Module):
    def __init__(self, vocab: int = 8192, d_model: int = 416, layers: int = 8, heads: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(DecoderLayer(d_model, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        for layer in self.layers:
            x = layer(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


SIZES = {
    # name: (vocab, d_model, layers, heads); "overhead" is about 20M parameters, "checkpoint" about 105M (>= 1 GB
    # of weights plus AdamW state in fp32)
    "smoke": (256, 32, 2, 2),
    "overhead": (8192, 416, 8, 8),
    "memory": (2048, 128, 4, 4),
    "checkpoint": (8192, 1024, 7, 16),
    # about the same state in 80 layers (a 70B Llama's count: 82 units, about 2,900 state tensors), for the per-unit
    # and per-tensor costs the 7 large layers hide
    "units80": (8192, 320, 80, 8),
}


def build(size: str) -> Decoder:
    vocab, d_model, layers, heads = SIZES[size]
    return Decoder(vocab, d_model, layers, heads)


def batch(size: str, step: int, rank: int, batch_size: int = 4, seq: int = 64) -> torch.Tensor:
    vocab = SIZES[size][0]
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (batch_size, seq + 1), generator=g)


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
