"""A small vision transformer (ViT, Dosovitskiy et al. 2021) in plain PyTorch: the model, data and loss factories
that ``parameters/vision.yaml`` names, and its hand FLOP count.

- ``model: examples.vision.vit:vit``: patch embedding (a strided ``nn.Conv2d``), a learnable class token and
  position embedding (``nn.Parameter``s: no ``nn.Embedding``, so the workbook does not take it for a token model),
  ``depth`` pre-norm blocks (fused qkv, non-causal ``F.scaled_dot_product_attention``, GELU MLP), a final
  LayerNorm and a linear head on the class token. ``forward(images (B, 3, H, W) float) -> logits (B, classes)``.
- ``data: examples.vision.vit:images``: a map-style Dataset of seeded random images and labels,
  items ``(image (3, H, W) float32, label int64)``.
- ``loss: examples.vision.vit:loss``: cross-entropy of the logits against the batch's labels.
- :func:`flops_per_sample`: the matmul FLOPs of one sample's forward and backward, term by term.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not a multiple of heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, mlp_ratio * dim)
        self.fc2 = nn.Linear(mlp_ratio * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=False)  # (b, heads, t, d / heads)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ViT(nn.Module):
    def __init__(self, image_size: int = 64, patch: int = 8, dim: int = 192, depth: int = 4, heads: int = 3,
                 classes: int = 10, mlp_ratio: int = 4):
        super().__init__()
        if image_size % patch:
            raise ValueError(f"image_size {image_size} is not a multiple of patch {patch}")
        self.image_size = image_size
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, mlp_ratio) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, N, dim), N = (H / patch) * (W / patch)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))


def vit(image_size: int = 64, patch: int = 8, dim: int = 192, depth: int = 4, heads: int = 3, classes: int = 10,
        mlp_ratio: int = 4) -> nn.Module:
    """The model factory (``model: examples.vision.vit:vit``); its defaults are ViT-64: 64x64 images, 8x8
    patches (64 patches + the class token = 65 tokens), dim 192, 4 blocks of 3 heads, 10 classes."""
    return ViT(image_size, patch, dim, depth, heads, classes, mlp_ratio)


class Images(Dataset):
    """Item i: a seeded random image (3, H, W) float32 and label int64, the same for the same (seed, i) in any
    process (DataLoader workers included)."""

    def __init__(self, n: int = 512, image_size: int = 64, classes: int = 10, seed: int = 0):
        self.n, self.image_size, self.classes, self.seed = n, image_size, classes, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        image = torch.randn(3, self.image_size, self.image_size, generator=g)
        label = torch.randint(0, self.classes, (), generator=g)
        return image, label


def images(rank: int = 0, world_size: int = 1, n: int = 512, image_size: int = 64, classes: int = 10,
           seed: int = 0) -> Dataset:
    """The data factory (``data: examples.vision.vit:images``): a map-style Dataset, so the workbook splits it
    over data-parallel ranks itself (``DistributedSampler``); ``rank`` and ``world_size`` are not needed here."""
    return Images(n, image_size, classes, seed)


def loss(output: torch.Tensor, batch) -> torch.Tensor:
    """The loss factory (``loss: examples.vision.vit:loss``): ``batch`` is the collated pair (images, labels)."""
    return F.cross_entropy(output.float(), batch[1])


def flops_per_sample(image_size: int = 64, patch: int = 8, dim: int = 192, depth: int = 4, heads: int = 3,
                     classes: int = 10, mlp_ratio: int = 4) -> int:
    """Model FLOPs of one sample's forward and backward: matmuls only, 2·m·n·k for an (m×k)·(k×n) product.

    With P = (image_size / patch)² patches, T = P + 1 tokens (the class token) and d = dim, the forward is:

    - patch embedding, the conv as a matmul (P × 3·patch²)·(3·patch² × d):   C = 2·P·(3·patch²)·d
    - per block, L = depth of them:
        qkv (T × d)·(d × 3d):                       2·T·d·3d = 6·T·d²
        scores QKᵀ, all heads (T × d/h)·(d/h × T):   2·T·T·d
        weighted sum AV, all heads (T × T)·(T × d/h): 2·T·T·d
        proj (T × d)·(d × d):                       2·T·d²
        MLP (T × d)·(d × r·d) and back:              2·2·T·d·(r·d) = 4·r·T·d²
      so per block (24 T·d² at r = 4) + 4·T²·d
    - head on the class token only (1 × d)·(d × classes):  2·d·classes

    Backward: each matmul's gradient w.r.t. its input and w.r.t. its weight is another matmul of the same size,
    2× the forward (SDPA's backward: dQ, dK, dV and dScores, 4 matmuls = 2× its 2). So forward + backward is 3×
    the forward, except for the first layer: the images do not require gradients, so the conv's gradient w.r.t.
    its input is never computed and the patch embedding costs 2·C (forward + weight gradient), not 3·C::

        flops = 3·(C + L·(6 + 2 + 4·r)·T·d² + L·4·T²·d + 2·d·classes) - C

    ViT-64 (64², patch 8, d 192, 4 blocks, 3 heads, 10 classes): P = 64, T = 65, C = 4,718,592, a block 60,752,640,
    head 3,840: forward 247,732,992, and 3 × 247,732,992 - 4,718,592 = 738,480,384, what FlopCounterMode counts
    for one forward+backward per sample (with the workbook's mapping for CPU's fused attention). Bias adds,
    LayerNorm, GELU, softmax and the loss are not matmuls and are not counted, as FlopCounterMode does not.
    ``heads`` does not change the count (the heads split d).
    """
    del heads
    p = (image_size // patch) ** 2
    t = p + 1
    d = dim
    conv = 2 * p * (3 * patch * patch) * d
    block = (6 + 2 + 4 * mlp_ratio) * t * d * d + 4 * t * t * d
    head = 2 * d * classes
    return 3 * (conv + depth * block + head) - conv
