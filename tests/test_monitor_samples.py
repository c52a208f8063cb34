"""The monitor on work that is not tokens: ``step(samples=)`` for images or rows, samples/s and MFU from FLOPs per
sample (given, or counted in one step), the unit named in every interval record; ``step(tokens=)`` unchanged.

No assert depends on the machine's speed: each figure is checked against the formula over the record's own
measured seconds (``wall_s - other_s``), with the peak given.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from examples.regression.mlp import flops_per_sample, mlp
from mfu_lab.analysis.monitor.summary import summarise
from mfu_lab.monitor import Monitor

PEAK = 1e12  # given: no CPU peak is measured, and MFU is a formula of the record's own seconds
BATCH, DIM, HIDDEN, DEPTH = 4, 16, 32, 3


def records(folder: Path) -> list[dict]:
    (f,) = folder.glob("*.jsonl")
    return [json.loads(line) for line in f.read_text().splitlines()]


def train(mon: Monitor, steps: int, batch: int = BATCH, **step_kwargs) -> None:
    torch.manual_seed(0)
    model = mon.model or mlp(DIM, HIDDEN, DEPTH)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn(batch, DIM)
        torch.nn.functional.mse_loss(model(x), x).backward()
        opt.step()
        opt.zero_grad()
        mon.step(**step_kwargs)


def intervals(recs: list[dict]) -> list[dict]:
    iv = [r for r in recs if r["kind"] == "interval"]
    assert iv
    return iv


def test_samples_with_flops_per_sample_give_samples_per_s_and_mfu_by_the_formula(tmp_path):
    fps = 1.5e6
    with Monitor(tmp_path, flops_per_sample=fps, peak_flops=PEAK, every=2, profile_every_s=None) as mon:
        train(mon, 7, samples=BATCH)
    recs = records(tmp_path)
    start = recs[0]
    assert start["flops"]["source"] == "analytic" and start["flops"]["per_sample"] == fps
    assert start["flops"]["unit"] == "samples"
    iv = intervals(recs)
    assert sum(r["steps"] for r in iv) == 6  # the first step is the warm-up
    for r in iv:
        train_s = r["wall_s"] - r["other_s"]
        assert r["unit"] == "samples/s"
        assert r["samples"] == BATCH * r["steps"]
        assert r["samples_per_s"] == pytest.approx(r["samples"] / train_s)
        assert r["tokens"] is None and r["tokens_per_s"] is None
        assert r["mfu"] == pytest.approx(fps * r["samples"] / (train_s * PEAK))
    assert mon.errors == {}


def test_samples_with_a_counted_step_give_flops_per_sample_equal_to_the_hand_formula(tmp_path):
    """No formula given: one step is counted (FlopCounterMode); FLOPs per sample = the step's count / its samples,
    and for the MLP that is examples.regression.mlp.flops_per_sample (SGD's update holds no matmul)."""
    model = mlp(DIM, HIDDEN, DEPTH)
    with Monitor(tmp_path, model=model, peak_flops=PEAK, every=2, profile_every_s=None) as mon:
        train(mon, 8, samples=BATCH)
    recs = records(tmp_path)
    (fl,) = [r for r in recs if r["kind"] == "flops"]
    assert fl["source"] == "counted" and fl["samples"] == BATCH and fl["tokens"] is None
    assert fl["per_step"] == BATCH * flops_per_sample(DIM, HIDDEN, DEPTH)
    assert fl["per_sample"] == flops_per_sample(DIM, HIDDEN, DEPTH) and fl["per_token"] is None
    iv = intervals(recs)
    assert sum(r["steps"] for r in iv) == 6  # the warm-up and the counted step are left out of the timing
    for r in iv:
        train_s = r["wall_s"] - r["other_s"]
        assert r["unit"] == "samples/s" and r["samples"] == BATCH * r["steps"]
        assert r["mfu"] == pytest.approx(fl["per_sample"] * r["samples"] / (train_s * PEAK))
        assert r["mfu"] == pytest.approx(fl["per_step"] * r["steps"] / (train_s * PEAK))  # same batch every step


def test_mfu_follows_the_samples_when_the_batch_size_varies(tmp_path):
    """FLOPs per sample x samples, not FLOPs per step x steps: a half batch counts half the FLOPs."""
    fps = 2.0e6
    with Monitor(tmp_path, flops_per_sample=fps, peak_flops=PEAK, every=4, profile_every_s=None) as mon:
        model = mlp(DIM, HIDDEN, DEPTH)
        for n in [BATCH, BATCH, BATCH // 2, BATCH, BATCH // 2]:
            model(torch.randn(n, DIM)).sum().backward()
            mon.step(samples=n)
    (r,) = intervals(records(tmp_path))
    assert r["steps"] == 4 and r["samples"] == BATCH + BATCH // 2 + BATCH + BATCH // 2
    assert r["mfu"] == pytest.approx(fps * r["samples"] / ((r["wall_s"] - r["other_s"]) * PEAK))


def test_tokens_work_as_before_and_name_their_unit(tmp_path):
    fpt = 3.0e5
    with Monitor(tmp_path, flops_per_token=fpt, peak_flops=PEAK, every=3, profile_every_s=None) as mon:
        train(mon, 4, tokens=BATCH * 8)
    recs = records(tmp_path)
    assert recs[0]["flops"]["per_token"] == fpt and "per_sample" not in recs[0]["flops"]
    (r,) = intervals(recs)
    train_s = r["wall_s"] - r["other_s"]
    assert r["unit"] == "tokens/s" and r["tokens"] == 3 * BATCH * 8
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / train_s)
    assert r["samples"] is None and r["samples_per_s"] is None
    assert r["mfu"] == pytest.approx(fpt * r["tokens"] / (train_s * PEAK))


def test_tokens_and_samples_together_keep_tokens_as_the_unit_and_for_mfu(tmp_path):
    fpt = 3.0e5
    with Monitor(tmp_path, flops_per_token=fpt, peak_flops=PEAK, every=3, profile_every_s=None) as mon:
        train(mon, 4, tokens=BATCH * 8, samples=BATCH)
    (r,) = intervals(records(tmp_path))
    train_s = r["wall_s"] - r["other_s"]
    assert r["unit"] == "tokens/s" and r["samples"] == 3 * BATCH
    assert r["samples_per_s"] == pytest.approx(3 * BATCH / train_s)
    assert r["mfu"] == pytest.approx(fpt * r["tokens"] / (train_s * PEAK))


def test_no_count_given_names_no_unit_and_mfu_comes_from_the_counted_step(tmp_path):
    model = mlp(DIM, HIDDEN, DEPTH)
    with Monitor(tmp_path, model=model, peak_flops=PEAK, every=2, profile_every_s=None) as mon:
        train(mon, 4)
    recs = records(tmp_path)
    (fl,) = [r for r in recs if r["kind"] == "flops"]
    assert fl["per_token"] is None and fl["per_sample"] is None
    (r,) = intervals(recs)
    assert r["unit"] is None and r["samples"] is None and r["tokens"] is None
    assert r["mfu"] == pytest.approx(fl["per_step"] * r["steps"] / ((r["wall_s"] - r["other_s"]) * PEAK))


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="flops_per_sample"):
        Monitor(tmp_path, flops_per_sample=-1.0)
    with pytest.raises(ValueError, match="give one"):
        Monitor(tmp_path, flops_per_token=1.0, flops_per_sample=1.0)
    mon = Monitor(tmp_path, flops_per_sample=1e6, peak_flops=PEAK, every=2, profile_every_s=None)
    with pytest.warns(UserWarning, match="sample count"):
        for n in (BATCH, float("nan"), BATCH, BATCH):
            mon.step(samples=n)
    mon.close()
    assert mon.errors == {"samples": 1}  # counted, training went on
    iv = intervals(records(tmp_path))
    assert sum(r["steps"] for r in iv) == 3 and sum(r["samples"] for r in iv) == 2 * BATCH  # the bad one left out


def test_the_report_reads_a_samples_run(tmp_path):
    """The summary reads the records of a samples run: MFU as recorded (tokens/s unknown, not 0)."""
    fps = 1.5e6
    with Monitor(tmp_path, flops_per_sample=fps, peak_flops=PEAK, every=2, profile_every_s=None) as mon:
        train(mon, 5, samples=BATCH)
    iv = intervals(records(tmp_path))
    s = summarise(tmp_path, progress=lambda line: None)
    assert s.read["skipped_records"] == 0 and s.read["intervals"] == len(iv)
    train_s = [r["wall_s"] - r["other_s"] for r in iv]
    assert s.mfu["value"] == pytest.approx(sum(r["mfu"] * t for r, t in zip(iv, train_s)) / sum(train_s))
    assert s.tokens_per_s["value"] is None
    # samples/s of all ranks: each rank's samples over its training time, x ranks (one rank here)
    assert s.samples_per_s["value"] == pytest.approx(sum(r["samples"] for r in iv) / sum(train_s))
    assert s.samples_per_s["label"] == "measured"
    from mfu_lab.core.store.results import jsonable
    from mfu_lab.report.monitor_views import monitor_section

    page = str(monitor_section(jsonable(s), None))
    assert "samples/s, all ranks" in page and "tokens/s, all ranks" not in page
