"""A small MLP that denoises vectors, diffusion-style (it predicts the noise added to a clean vector): the model,
data and loss factories that ``parameters/regression.yaml`` names, and its hand FLOP count.

- ``model: examples.regression.mlp:mlp``: ``depth`` linear layers, dim -> hidden -> ... -> hidden -> dim, GELU
  between them. ``forward(x (B, dim) float) -> (B, dim)``.
- ``data: examples.regression.mlp:pairs``: a map-style Dataset of seeded pairs ``(noisy, noise)``, both
  float32 (dim,): ``noisy = clean + sigma * noise`` with ``clean`` a seeded smooth vector (a few sinusoids) and
  ``sigma`` seeded in [0.1, 1].
- ``loss: examples.regression.mlp:loss``: mean squared error of the predicted noise.
- :func:`flops_per_sample`: the matmul FLOPs of one sample's forward and backward.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


def mlp(dim: int = 256, hidden: int = 1024, depth: int = 3) -> nn.Module:
    """The model factory (``model: examples.regression.mlp:mlp``): ``depth`` >= 2 linear layers."""
    if depth < 2:
        raise ValueError(f"depth {depth}: at least 2 linear layers (dim -> hidden -> dim)")
    widths = [dim] + [hidden] * (depth - 1) + [dim]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        if i:
            layers.append(nn.GELU())
        layers.append(nn.Linear(a, b))
    return nn.Sequential(*layers)


class Pairs(Dataset):
    """Item i: ``(clean + sigma * noise, noise)``, float32 (dim,), the same for the same (seed, i) in any process."""

    def __init__(self, n: int = 2048, dim: int = 256, seed: int = 0):
        self.n, self.dim, self.seed = n, dim, seed
        self._x = torch.linspace(0.0, 2 * math.pi, dim)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        amp, freq, phase = torch.rand(3, 4, generator=g)
        clean = (amp[:, None] * torch.sin((1 + 7 * freq[:, None]) * self._x + 2 * math.pi * phase[:, None])).sum(0)
        sigma = 0.1 + 0.9 * torch.rand((), generator=g)
        noise = torch.randn(self.dim, generator=g)
        return clean + sigma * noise, noise


def pairs(rank: int = 0, world_size: int = 1, n: int = 2048, dim: int = 256, seed: int = 0) -> Dataset:
    """The data factory (``data: examples.regression.mlp:pairs``): a map-style Dataset, which the workbook splits
    over data-parallel ranks itself; ``rank`` and ``world_size`` are not needed here."""
    return Pairs(n, dim, seed)


def loss(output: torch.Tensor, batch) -> torch.Tensor:
    """The loss factory (``loss: examples.regression.mlp:loss``): ``batch`` is the collated pair (input, target)."""
    return F.mse_loss(output.float(), batch[1])


def flops_per_sample(dim: int = 256, hidden: int = 1024, depth: int = 3) -> int:
    """Model FLOPs of one sample's forward and backward: matmuls only, 2·m·n·k for an (m×k)·(k×n) product.

    Forward, one row through ``depth`` linear layers::

        F = 2·dim·hidden (first) + (depth - 2)·2·hidden² (middle) + 2·hidden·dim (last)

    Backward: each layer's gradient w.r.t. its weight and w.r.t. its input is a matmul of the forward's size, 2·F,
    except that the input does not require gradients, so the first layer's input gradient (2·dim·hidden) is never
    computed::

        flops = 3·F - 2·dim·hidden

    Defaults (256, 1024, 3): F = 3,145,728 and 3·F - 524,288 = 8,912,896, what FlopCounterMode counts per sample.
    Bias adds, GELU and the loss are not matmuls and are not counted, as FlopCounterMode does not.
    """
    first = 2 * dim * hidden
    forward = first + (depth - 2) * 2 * hidden * hidden + 2 * hidden * dim
    return 3 * forward - first
