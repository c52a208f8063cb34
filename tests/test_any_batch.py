"""Any batch the job's own loss understands (issue 47): images and labels, regression pairs, dicts and lone tensors
are kept as the data gives them; FLOPs are counted per step and never scaled by targets or positions; token-id
batches keep their rules; a batch the workbook cannot feed names the key to set."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from examples.vision import vit as vis
from mfu_lab.core.engine.batches import (
    IGNORE,
    Batch,
    Rest,
    as_batch,
    loss_view,
    samples_of,
    shape_key,
    to_device,
)
from mfu_lab.core.engine.data import build_loader, takes_ids
from mfu_lab.core.engine.work import first_batch_facts, same_batches, work_rates
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.errors import StepError
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure.flops import count_key, count_step_flops
from mfu_lab.core.measure.timed import run_steps

from .conftest import ROOT

VIT64_FLOPS = 738_480_384  # per sample, forward + backward (issue 47's hand count)


def vision_job(tmp_path, **kw):
    return dataclasses.replace(load_job(ROOT / "parameters" / "vision.yaml"), out_dir=str(tmp_path), **kw)


# ------------------------------------------------------------------ the batch forms
def test_an_image_pair_is_kept_as_it_is_when_other_batches_are_accepted():
    images, labels = torch.rand(4, 3, 8, 8), torch.tensor([1, 2, IGNORE, 0])
    b = as_batch((images, labels), ids=False, other=True)
    assert b.tokens is False and b[0] is images and b[1] is labels and b.kwargs == {}
    assert loss_view(b[0], b[1], b.kwargs) == (images, labels)
    assert samples_of(b) == 4
    # a model with a token embedding and a loss of its own: the token forms first, then any other batch
    b = as_batch((images, labels), ids=True, other=True)
    assert b.tokens is False


def test_token_forms_stay_token_batches():
    ids = torch.randint(0, 9, (2, 5))
    b = as_batch((ids, ids), ids=True, other=True)
    assert b.tokens is True
    b = as_batch(ids, ids=True, other=False)
    assert b.tokens is True and b[1][0, -1] == IGNORE


def test_dicts_lone_tensors_and_longer_tuples():
    d = {"pixel_values": torch.rand(2, 3, 4, 4), "labels": torch.tensor([0, 1])}
    b = as_batch(d, ids=False, other=True)
    assert b.tokens is False and b[0] is d and b[1] is None and loss_view(b[0], b[1], {}) is d
    t = torch.rand(3, 7)
    b = as_batch(t, ids=False, other=True)
    assert b[0] is t and loss_view(b[0], b[1], {}) is t and samples_of(b) == 3
    a, c, e = torch.rand(2, 3), torch.rand(2), torch.rand(2, 1)
    b = as_batch((a, c, e), ids=False, other=True)
    assert isinstance(b[1], Rest) and loss_view(b[0], b[1], {}) == (a, c, e)
    moved = to_device(b[1], "cpu")
    assert isinstance(moved, Rest) and len(moved) == 2


def test_a_float_batch_without_a_loss_names_the_key_its_shape_dtype_and_the_readme_section():
    with pytest.raises(StepError) as e:
        as_batch((torch.rand(4, 3, 8, 8), torch.tensor([1, 2, 3, 0])), ids=True, other=False)
    msg = str(e.value)
    assert "key 'loss'" in msg and "(4, 3, 8, 8)" in msg and "torch.float32" in msg
    assert "README, 'Your own model and data'" in msg


def test_the_flop_cache_key_holds_for_dicts_and_tuples():
    small, large = {"x": torch.rand(2, 3, 8, 8)}, {"x": torch.rand(2, 3, 16, 16)}
    assert shape_key(small) != shape_key(large)
    assert shape_key((torch.rand(2, 3), torch.rand(2))) != shape_key((torch.rand(2, 3), torch.rand(2, 1)))
    assert shape_key(torch.zeros(2, 3, dtype=torch.long)) != shape_key(torch.zeros(2, 3))
    model = nn.Linear(3, 2)
    assert count_key(model, None, small, None) != count_key(model, None, large, None)


def test_a_saved_comparison_batch_keeps_its_form(tmp_path):
    """same_batches saves a factory's batches once for every candidate: an image pair comes back an image pair."""
    job = vision_job(tmp_path, micro_batch=2)
    first = list(same_batches(job, 2, "cpu"))
    again = list(same_batches(job, 2, "cpu"))
    assert [b.tokens for b in again] == [False, False]
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))


# ------------------------------------------------------------------ the job's facts
def test_the_vision_job_is_not_a_token_job(tmp_path):
    job = vision_job(tmp_path, micro_batch=4)
    assert takes_ids(job) is False
    assert first_batch_facts(job) == (False, 4)
    tokens_per_s, samples_per_s = work_rates(job, 2.0, ranks=3)
    assert tokens_per_s is None and samples_per_s == 4 * 3 * 2.0


# ------------------------------------------------------------------ FLOPs and the timed steps
def test_vit64_through_the_workbook_counts_the_hand_formula_per_sample(tmp_path):
    job = vision_job(tmp_path, micro_batch=2)
    model = build_model(job).train()
    step = build_train_step(job, model, "cpu")
    x, y = next(iter(build_loader(job, 1, "cpu")))
    report = count_step_flops(model, step, x, y)
    assert report.model_flops_source == "counted"
    assert report.model_flops_per_step == 2 * VIT64_FLOPS == 2 * vis.flops_per_sample()


def test_targets_of_minus_100_in_an_image_batch_scale_nothing():
    """Timed steps count samples for every batch and tokens only for token ids: an image batch whose labels hold
    -100 has no tokens counted, so nothing scales its FLOPs."""
    images, labels = torch.rand(3, 2), torch.tensor([IGNORE, IGNORE, 1])
    batches = [Batch(images, labels, tokens=False) for _ in range(3)]
    seen = []
    t = run_steps(lambda x, y: seen.append((x.shape, y.shape)) or torch.tensor(1.0), batches, torch.device("cpu"),
                  1, 2)
    assert t.tokens is None and t.padded_tokens is None and t.measured_tokens() is None
    assert t.samples == [3, 3, 3] and t.measured_samples() == 6
    assert seen == [((3, 2), (3,))] * 3
    tokens = [Batch(torch.zeros(2, 4, dtype=torch.long), torch.full((2, 4), IGNORE)) for _ in range(2)]
    tokens[1][1][0, :2] = 5
    t = run_steps(lambda x, y: torch.tensor(1.0), tokens, torch.device("cpu"), 0, 2)
    assert t.tokens == [0, 2] and t.padded_tokens == [8, 8]


def test_a_dict_batch_goes_into_the_forward_as_its_keywords():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, features, scale=1.0):
            return self.lin(features) * scale

    from mfu_lab.core.engine.workload import TrainStep

    model = Net()
    seen = {}

    def loss(out, batch):
        seen["batch"] = sorted(batch)
        return ((out.squeeze(-1) - batch["target"]) ** 2).mean()

    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu", "float32", 0, loss_fn=loss,
                     reference=False)
    batch = as_batch({"features": torch.rand(5, 4), "target": torch.rand(5)}, ids=False, other=True)
    value = step(batch[0], batch[1])
    assert value.shape == () and seen["batch"] == ["features", "target"]


def test_a_dict_whose_keys_the_forward_does_not_take_says_so():
    from mfu_lab.core.engine.workload import TrainStep

    model = nn.Linear(4, 1)
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu", "float32", 0,
                     loss_fn=lambda out, b: out.mean(), reference=False)
    with pytest.raises(StepError, match="takes none of its keys"):
        step.loss({"pixels": torch.rand(2, 4)}, None)


def test_an_image_batch_without_a_loss_names_the_key():
    from mfu_lab.core.engine.workload import TrainStep

    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.1), "cpu", "float32", 0, reference=False)
    with pytest.raises(StepError) as e:
        step.loss(torch.rand(2, 3, 2, 2), torch.tensor([0, 1]))
    assert "key 'loss'" in str(e.value) and "(2, 3, 2, 2)" in str(e.value)
