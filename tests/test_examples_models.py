"""The non-token examples (examples/vision/vit.py, examples/regression/mlp.py): their hand FLOP formulas against
FlopCounterMode, their seeded data factories, their losses, and the job files that name them."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.flop_counter import FlopCounterMode

from examples.regression import mlp as reg
from examples.vision import vit as vis
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure.flops import count_flops

from .conftest import ROOT

VIT64_FLOPS = 738_480_384  # per sample, forward + backward: the issue's figure


def one_batch(dataset: Dataset, n: int):
    """The first ``n`` items collated as the workbook's DataLoader collates them (a pair of stacked tensors)."""
    return next(iter(DataLoader(dataset, batch_size=n)))


def counted_per_sample(model: torch.nn.Module, loss_fn, batch, n: int) -> float:
    """One forward + backward of ``batch`` under the workbook's counter (FlopCounterMode with the attention mapping
    that counts CPU's fused SDPA kernel), per sample."""
    return count_flops(lambda: loss_fn(model(batch[0]), batch).backward()).total / n


def test_vit64_hand_formula_is_the_issues_count_and_flopcountermode_s():
    assert vis.flops_per_sample() == VIT64_FLOPS
    torch.manual_seed(0)
    model = vis.vit()
    batch = one_batch(vis.images(), 2)
    assert batch[0].shape == (2, 3, 64, 64) and batch[0].dtype == torch.float32
    assert counted_per_sample(model, vis.loss, batch, 2) == VIT64_FLOPS


def test_vit64_terms():
    """3 x forward less the conv's input gradient, which is never computed (the images need no gradient)."""
    p, t, d = 64, 65, 192
    conv = 2 * p * (3 * 8 * 8) * d
    block = 2 * t * d * 3 * d + 2 * t * t * d + 2 * t * t * d + 2 * t * d * d + 2 * 2 * t * d * 4 * d
    forward = conv + 4 * block + 2 * d * 10
    assert (conv, block, forward) == (4_718_592, 60_752_640, 247_732_992)
    assert 3 * forward - conv == VIT64_FLOPS
    # torch's own table has no entry for CPU's fused attention (it counts 0 there): the difference is exactly the
    # attention's QK^T and AV, forward (4 T^2 d) and backward (twice that), over the 4 blocks
    torch.manual_seed(0)
    model, batch = vis.vit(), one_batch(vis.images(), 2)
    with FlopCounterMode(display=False) as mode:
        vis.loss(model(batch[0]), batch).backward()
    assert VIT64_FLOPS - mode.get_total_flops() / 2 == 3 * 4 * (4 * t * t * d)


@pytest.mark.parametrize("kwargs", [{"image_size": 32, "patch": 4, "dim": 64, "depth": 2, "heads": 4, "classes": 7},
                                    {"image_size": 16, "patch": 8, "dim": 48, "depth": 1, "heads": 2, "classes": 3,
                                     "mlp_ratio": 2}])
def test_vit_hand_formula_matches_the_counter_on_other_shapes(kwargs):
    torch.manual_seed(0)
    model = vis.vit(**kwargs)
    data = {k: v for k, v in kwargs.items() if k in ("image_size", "classes")}
    batch = one_batch(vis.images(n=8, **data), 3)
    assert model(batch[0]).shape == (3, kwargs["classes"])
    assert counted_per_sample(model, vis.loss, batch, 3) == vis.flops_per_sample(**kwargs)


def test_vit_has_no_embedding_table():
    """The workbook takes a model with nn.Embedding for a token model: the ViT's embeddings are parameters."""
    model = vis.vit()
    assert not any(isinstance(m, torch.nn.Embedding) for m in model.modules())
    assert isinstance(model.pos_embed, torch.nn.Parameter) and model.pos_embed.shape == (1, 65, 192)


@pytest.mark.parametrize("kwargs", [{}, {"dim": 64, "hidden": 128, "depth": 5}, {"dim": 32, "hidden": 48, "depth": 2}])
def test_regression_hand_formula_matches_the_counter(kwargs):
    torch.manual_seed(0)
    model = reg.mlp(**kwargs)
    batch = one_batch(reg.pairs(n=8, dim=kwargs.get("dim", 256)), 4)
    assert counted_per_sample(model, reg.loss, batch, 4) == reg.flops_per_sample(**kwargs)
    # no attention here: torch's own counter agrees too
    with FlopCounterMode(display=False) as mode:
        reg.loss(model(batch[0]), batch).backward()
    assert mode.get_total_flops() / 4 == reg.flops_per_sample(**kwargs)
    if not kwargs:
        assert reg.flops_per_sample() == 8_912_896  # 3 x 3,145,728 - 2 x 256 x 1024


def test_data_factories_are_seeded():
    a, b = vis.images(), vis.images(rank=1, world_size=2)
    assert len(a) == 512
    (xa, ya), (xb, yb) = a[5], b[5]
    assert torch.equal(xa, xb) and torch.equal(ya, yb)  # the same item twice, in another "process"
    assert xa.shape == (3, 64, 64) and xa.dtype == torch.float32 and ya.dtype == torch.int64 and 0 <= ya < 10
    assert not torch.equal(a[5][0], a[6][0])
    assert not torch.equal(vis.images(seed=1)[5][0], xa)
    p, q = reg.pairs(), reg.pairs()
    assert len(p) == 2048
    (xp, tp), (xq, tq) = p[7], q[7]
    assert torch.equal(xp, xq) and torch.equal(tp, tq)
    assert xp.shape == tp.shape == (256,) and xp.dtype == tp.dtype == torch.float32
    assert not torch.equal(p[7][1], p[8][1])
    assert not torch.equal(reg.pairs(seed=1)[7][1], tp)
    with pytest.raises(IndexError):
        a[512]


def test_losses_take_the_output_and_the_batch():
    torch.manual_seed(0)
    images = one_batch(vis.images(n=4), 4)
    logits = torch.zeros(4, 10, dtype=torch.bfloat16)
    assert vis.loss(logits, images).item() == pytest.approx(torch.log(torch.tensor(10.0)).item())
    pairs = one_batch(reg.pairs(n=4), 4)
    out = torch.zeros(4, 256)
    assert reg.loss(out, pairs).item() == pytest.approx(pairs[1].pow(2).mean().item())


@pytest.mark.parametrize("name, model, data, loss", [
    ("vision", "examples.vision.vit:vit", "examples.vision.vit:images", "examples.vision.vit:loss"),
    ("regression", "examples.regression.mlp:mlp", "examples.regression.mlp:pairs", "examples.regression.mlp:loss")])
def test_job_files_validate(name, model, data, loss):
    job = load_job(ROOT / "parameters" / f"{name}.yaml")
    assert (job.job_name, job.model, job.data, job.loss) == (name, model, data, loss)
    assert (job.micro_batch, job.steps, job.warmup_steps) == (32, 10, 2)
