"""A sweep's pick confirmed side by side before it is recommended (steps 2 and 4, racing and thorough alike)."""

from __future__ import annotations

import dataclasses

from mfu_lab.analysis import racing
from mfu_lab.core.budget import Clock
from mfu_lab.core.job import Job, load_job
from mfu_lab.core.thresholds import RACE_CONFIRM_TURNS
from mfu_lab.steps import comm_race, compile_confirm
from mfu_lab.steps.attention_comm import CommRow, _recommend
from mfu_lab.steps.compile import _confirmed
from mfu_lab.workers import launch
from mfu_lab.workers.launch import Alternation, config_key

from .conftest import TINY

DEFAULT = {"hook": "none", "bucket_mb": 25, "grad_as_bucket_view": False}
PICK = {"hook": "powersgd", "bucket_mb": 25, "grad_as_bucket_view": True}


def test_a_gain_inside_the_noise_is_not_proven_and_a_clear_one_is():
    ref = [0.50, 0.44, 0.47, 0.52, 0.45, 0.49, 0.46, 0.51, 0.48]
    same = [0.49, 0.45, 0.47, 0.51, 0.44, 0.50, 0.46, 0.52, 0.48]  # the same spread, drawn again
    lucky = racing.confirm("pick", "default", ref, same, 3, 3, ["default", "pick"] * 3)
    assert not lucky.proven and lucky.low < 1.0 < lucky.high
    assert "default stays" in lucky.text() and "measured side by side" in lucky.text()
    faster = [t * 0.8 for t in ref]  # every step a fifth shorter
    real = racing.confirm("pick", "default", ref, faster, 3, 3, ["default", "pick"] * 3)
    assert real.proven and real.speedup == 1.25 and real.low > 1.0 and "pick stands" in real.text()
    assert not racing.confirm("pick", "default", ref, [], 3, 3, []).proven  # a turn with no steps proves nothing


def test_the_ddp_pick_alternates_with_the_default_and_a_lucky_one_falls_back(tmp_path, monkeypatch):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    calls = []

    def fake_alternate(job, device_type, attention, configs, turns, work, progress=None):
        calls.append(([config_key(c) for c in configs], turns))
        walls = {config_key(DEFAULT): [0.50, 0.46, 0.48] * turns, config_key(PICK): [0.49, 0.47, 0.48] * turns}
        return Alternation(walls, [config_key(c) for c in configs] * turns, "", 3.0)

    monkeypatch.setattr(comm_race, "alternate", fake_alternate)
    c = comm_race.confirm_pick(job, "cpu", None, DEFAULT, PICK, tmp_path, Clock(None), {"seconds": 20.0}, 5)
    assert calls == [([config_key(DEFAULT), config_key(PICK)], RACE_CONFIRM_TURNS)]  # the reference runs first
    assert c.order == ["none/25MB/copy", "powersgd/25MB/view"] * RACE_CONFIRM_TURNS and not c.proven
    default = CommRow("none", 25, False, "ok", step_median_s=0.48, step_p10_s=0.46, step_p90_s=0.5, exposed_share=0.1,
                      mfu=0.5)
    text = _recommend(Job(), None, default, {}, c)["comm_text"]
    assert text.startswith("Keep DDP's defaults") and "powersgd/25MB/view led the sweep" in text and "stays" in text


def test_a_budget_without_room_leaves_the_default_and_says_so(tmp_path, monkeypatch):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    monkeypatch.setattr(comm_race, "alternate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    clock = Clock(planned_s=0.0)
    c = comm_race.confirm_pick(job, "cpu", None, DEFAULT, PICK, tmp_path, clock, {"seconds": 20.0}, 5)
    assert c.status == "skipped" and not c.proven and c.reason.startswith("budget:")
    assert clock.shortened and clock.shortened[0]["what"] == "DDP confirmation"


def test_alternate_runs_the_configurations_turn_by_turn_in_one_launch(tmp_path):
    """A real torchrun launch of two gloo ranks: A B A B, each turn a fresh DDP model timed for comm_steps."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    other = {"hook": "allreduce", "bucket_mb": 1, "grad_as_bucket_view": True}
    run = launch.alternate(job, "cpu", None, [DEFAULT, other], 2, tmp_path / "alt")
    assert run.error == "", run.error
    assert run.order == [config_key(DEFAULT), config_key(other)] * 2
    assert all(len(w) == 2 * job.comm_steps and min(w) > 0 for w in run.walls.values())


def test_a_compile_mode_is_confirmed_beside_eager_in_interleaved_rounds(tmp_path):
    """Two real rung processes (dynamo with the eager backend, so no compiler runs): eager, mode, eager, mode..."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), compile_backend="eager")
    lines = []
    c = compile_confirm.confirm_mode(job, "default", tmp_path / "cache", tmp_path / "confirm", Clock(None), 5.0,
                                     0.01, lines.append)
    assert c.status == "ok", c.reason
    assert c.order == ["eager", "default"] * RACE_CONFIRM_TURNS and c.turns == RACE_CONFIRM_TURNS
    assert c.steps == compile_confirm.turn_steps(job) and c.speedup == c.reference_median_s / c.candidate_median_s
    assert any("round 1/" in line for line in lines)


def test_an_unproven_mode_leaves_the_job_eager_and_says_which_led():
    rec = {"shapes_first": False, "compile": True, "mode": "max-autotune-no-cudagraphs", "break_even_cold": 1390.0,
           "text": "Compile with torch.compile(model, mode='max-autotune-no-cudagraphs'): step 241.0 -> 227.9 ms "
                   "(1.06x); pays for itself after 1390 steps of a cold compile (18.2 s)."}
    lucky = racing.confirm("max-autotune-no-cudagraphs", "eager", [0.22, 0.23, 0.21] * 3, [0.22, 0.21, 0.23] * 3, 3, 3,
                           [])
    out = _confirmed(rec, lucky)
    assert out["compile"] is False and "mode" not in out and out["led"] == "max-autotune-no-cudagraphs"
    assert out["text"].startswith("Stay eager: mode max-autotune-no-cudagraphs led (step 241.0 -> 227.9 ms")
    proven = racing.confirm("max-autotune-no-cudagraphs", "eager", [0.22, 0.23, 0.21] * 3, [0.11, 0.12, 0.1] * 3, 3,
                            3, [])
    kept = _confirmed(rec, proven)
    assert kept["compile"] and kept["mode"] == rec["mode"] and "stands" in kept["text"]
