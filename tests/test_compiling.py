"""Step 4's pieces: the data's shapes, recompile counting, break-even and loss-drift arithmetic."""

import dataclasses
import math

import pytest
import torch

from mfu_lab.analysis import recompiles as cp
from mfu_lab.core.engine.workload import IGNORE, bucket_lengths, build_loader, build_model
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import load_job

from .conftest import TINY

VARLEN = {"data": "synthetic_varlen", "min_seq_len": 8}


def audit(**over):
    job = load_job(TINY, VARLEN | over)
    return cp.audit_shapes(build_loader(job, 0, "cpu", n_samples=over.get("dataset_samples", 22)), "test")


def test_fixed_data_has_one_shape():
    job = load_job(TINY)
    a = cp.audit_shapes(build_loader(job, 5, "cpu"), "fixed")
    assert not a.varies and a.shapes == {"4x32": 5} and a.padding_fraction == 0.0


def test_each_length_policy_gives_the_shapes_it_promises():
    longest = audit(seq_policy="longest")
    assert longest.varies and longest.batch_sizes == [4] and longest.padding_fraction > 0
    padded = audit(seq_policy="pad")
    assert padded.shapes == {"4x32": 5} and padded.padding_fraction > longest.padding_fraction
    bucketed = audit(seq_policy="bucket", seq_buckets=4)
    assert set(bucketed.seq_lens) <= {8, 16, 24, 32}
    packed = audit(seq_policy="pack")
    assert packed.shapes == {"4x32": 5} and packed.padding_fraction == 0.0


def test_last_batch_policies():
    # 22 samples in batches of 4: five full batches and one of 2
    assert audit(seq_policy="pad", last_batch="drop").shapes == {"4x32": 5}
    assert audit(seq_policy="pad", last_batch="keep").shapes == {"4x32": 5, "2x32": 1}
    padded = audit(seq_policy="pad", last_batch="pad")
    assert padded.shapes == {"4x32": 6} and padded.epoch_samples == 24


def test_packing_keeps_every_token_in_order():
    job = load_job(TINY, VARLEN | {"seq_policy": "pack"})
    x, y = next(iter(build_loader(job, 1, "cpu")))
    assert not (y == IGNORE).any()
    # within one sample, the target is the next input token
    first = build_loader(dataclasses.replace(job, seq_policy="longest"), 1, "cpu").dataset[0]
    n = len(first[0])
    assert torch.equal(x[0, :n], first[0]) and torch.equal(y[0, :n], first[1])


def test_bucket_lengths():
    assert bucket_lengths(256, 4) == [64, 128, 192, 256]
    assert bucket_lengths(32, 4) == [8, 16, 24, 32]
    assert bucket_lengths(10, 4) == [8, 10]


def test_bad_data_keys_are_named():
    with pytest.raises(JobError) as err:
        load_job(TINY, {"seq_policy": "truncate", "min_seq_len": 99, "compile_modes": ["fast"]})
    text = str(err.value)
    assert "seq_policy" in text and "longest, pad, bucket, pack" in text
    assert "min_seq_len" in text and "<= seq_len (32)" in text
    assert "compile_modes" in text and "'fast'" in text


@pytest.fixture(scope="module")
def model():
    return build_model(load_job(TINY)).eval()


def test_recompiles_counted_with_two_lengths_under_static_shapes(model):
    xs = [torch.randint(128, (2, n)) for n in (32, 16)]
    run = cp.count_recompiles(model, xs, "static", "two lengths")
    assert run.recompiles == 1 and run.graphs == 2
    assert "size mismatch" in run.messages[0] and "expected 32, actual 16" in run.messages[0]
    three = cp.count_recompiles(model, xs + [torch.randint(128, (2, 24))], "static", "three lengths")
    assert three.recompiles == 2
    auto = cp.count_recompiles(model, xs + [torch.randint(128, (2, 24))], "auto", "three lengths")
    assert auto.recompiles == 1  # the second length recompiles as dynamic; the third fits


def test_no_recompile_with_fixed_shapes(model):
    xs = [torch.randint(128, (2, 32)) for _ in range(4)]
    for dynamic in ("static", "auto"):
        run = cp.count_recompiles(model, xs, dynamic, "fixed")
        assert run.recompiles == 0 and run.graphs == 1 and run.messages == []


def test_graph_breaks_are_found_and_explained():
    class Breaks(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            print("a side effect")  # a graph break
            return y + 1

    b = cp.graph_breaks(Breaks(), torch.ones(3))
    assert b.breaks == 1 and b.graphs == 2 and "print" in b.reasons[0]
    assert cp.graph_breaks(torch.nn.Linear(3, 3), torch.ones(2, 3)).breaks == 0


def test_compile_seconds_and_break_even():
    walls = [10.0, 1.5, 0.5, 0.5, 0.5]
    assert cp.compile_seconds(walls, 2, 0.5) == pytest.approx(10.5)  # 11.5 - 2 x 0.5
    assert cp.compile_seconds(walls, 2, 0.5, eager_extra=0.3) == pytest.approx(10.2)
    assert cp.break_even_steps(30.0, 0.8, 0.5) == pytest.approx(100.0)  # 30 s / 0.3 s per step
    assert cp.break_even_steps(30.0, 0.5, 0.5) is None and cp.break_even_steps(30.0, 0.5, 0.6) is None
    assert cp.break_even_steps(-1.0, 0.8, 0.5) == 0.0  # a compile faster than eager's first steps


def test_loss_drift_flags_a_wrong_comparison():
    eager = [4.85, 4.80, 4.71, 4.60]
    assert cp.loss_drift(eager, [4.85, 4.8000004, 4.7100003, 4.5999998]) < cp.DRIFT_TOLERANCE["float32"]
    wrong = [4.85, 4.80, 4.90, 5.20]  # a compiled step that learns something else
    assert cp.loss_drift(eager, wrong) == pytest.approx((5.20 - 4.60) / 4.60)
    assert cp.loss_drift(eager, wrong) > cp.DRIFT_TOLERANCE["float32"]
    assert cp.loss_drift(eager, [4.85, math.nan, 4.7, 4.6]) == math.inf
    with pytest.raises(ValueError, match="different lengths"):
        cp.loss_drift(eager, eager[:2])


def test_mode_kwargs():
    assert cp.mode_kwargs("default", "inductor", "auto", {}) == {"backend": "inductor", "dynamic": None}
    assert cp.mode_kwargs("reduce-overhead", "inductor", "static", {})["mode"] == "reduce-overhead"
    assert cp.mode_kwargs("options", "inductor", "dynamic", {"max_autotune": True}) == {
        "backend": "inductor", "dynamic": True, "options": {"max_autotune": True}}
