"""A sweep's pick confirmed side by side before it is recommended (steps 2 and 4, racing and thorough alike)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from mfu_lab.analysis import racing
from mfu_lab.core.job.schema import Job, load_job
from mfu_lab.core.process.budget import Clock
from mfu_lab.core.store.results import jsonable
from mfu_lab.core.thresholds import RACE_CONFIRM_TURNS
from mfu_lab.steps.attention_comm import comm_race
from mfu_lab.steps.attention_comm.step import CommRow, _recommend
from mfu_lab.steps.compile import confirm as compile_confirm
from mfu_lab.steps.compile.step import _confirmed
from mfu_lab.workers import alternate
from mfu_lab.workers.alternate import Alternation
from mfu_lab.workers.comm_configs import config_key
from mfu_lab.workers.launch import SweepOutcome, run_sweep

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
    c = comm_race.confirm_pick(job, "cpu", None, SweepOutcome({}, []), DEFAULT, PICK, tmp_path, Clock(None), 0.5)
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
    c = comm_race.confirm_pick(job, "cpu", None, SweepOutcome({}, []), DEFAULT, PICK, tmp_path, clock, 0.5)
    assert c.status == "skipped" and not c.proven and c.reason.startswith("budget:")
    assert clock.shortened and clock.shortened[0]["what"] == "DDP confirmation"


def test_alternate_runs_the_configurations_turn_by_turn_in_one_launch(tmp_path):
    """A real torchrun launch of two gloo ranks: A B A B, each turn a fresh DDP model timed for comm_steps."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    other = {"hook": "allreduce", "bucket_mb": 1, "grad_as_bucket_view": True}
    run = alternate.alternate(job, "cpu", None, [DEFAULT, other], 2, tmp_path / "alt")
    assert run.error == "", run.error
    assert run.order == [config_key(DEFAULT), config_key(other), config_key(other), config_key(DEFAULT)]  # ABBA
    assert all(len(w) == 2 * job.comm_steps and min(w) > 0 for w in run.walls.values())


def test_a_compile_mode_is_confirmed_beside_eager_in_interleaved_rounds(tmp_path):
    """Two real rung processes (dynamo with the eager backend, so no compiler runs): eager, mode, eager, mode..."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), compile_backend="eager")
    lines = []
    c = compile_confirm.confirm_mode(job, "cpu", "default", tmp_path / "cache", tmp_path / "confirm", Clock(None),
                                     5.0, 0.01, lines.append)
    assert c.status == "ok", c.reason
    assert c.order == ["eager", "default", "default", "eager", "eager", "default"] and c.turns == 3  # ABBA
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


def test_the_sweeps_own_turns_confirm_its_pick_without_another_launch(tmp_path, monkeypatch):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    monkeypatch.setattr(comm_race, "alternate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched")))
    sweep = SweepOutcome({}, [])
    sweep.confirm = {"event": "confirm", "candidate": "powersgd/25MB/view", "reference": "none/25MB/copy",
                     "turns": 2, "skipped": "", "done": True, "seconds": 4.0}
    sweep.turns = [{"event": "turn", "config": cfg, "turn": t, "wall_s": w}
                   for t in (1, 2) for cfg, w in ((DEFAULT, [0.50, 0.51, 0.52]), (PICK, [0.30, 0.31, 0.29]))]
    c = comm_race.confirm_pick(job, "cpu", None, sweep, DEFAULT, PICK, tmp_path, Clock(None), 0.5)
    assert c.proven and c.order == ["none/25MB/copy", "powersgd/25MB/view"] * 2 and c.seconds == 4.0
    other = dict(PICK, hook="fp16_compress")  # the step picked another configuration: its turns do not apply
    with pytest.raises(AssertionError, match="launched"):
        comm_race.confirm_pick(job, "cpu", None, sweep, DEFAULT, other, tmp_path, Clock(None), 0.5)


def test_the_worker_confirms_the_steps_pick_among_ranks_in_sync_and_within_the_budget():
    from mfu_lab.workers.ddp_rank import pick_to_confirm

    def done(walls, diff=0.0):
        return {"event": "done", "wall_s": walls, "param_checksum_max_diff": diff}

    full = {"ref": done([1.0, 1.01, 1.02]), "fast": done([0.5, 0.51, 0.52]), "faster but out of sync": done(
        [0.1, 0.1, 0.1], diff=1.0), "refused": None}
    spec = {"reference": "ref", "turns": 3, "deadline": None}
    assert pick_to_confirm(full, spec, 4) == {"candidate": "fast", "reference": "ref", "turns": 3, "skipped": ""}
    assert pick_to_confirm({"ref": full["ref"], "close": done([0.99, 1.0, 1.03])}, spec, 4) is None  # overlaps
    assert pick_to_confirm({"fast": full["fast"]}, spec, 4) is None  # no reference measured: nothing to confirm
    import time

    late = pick_to_confirm(full, dict(spec, deadline=time.time() + 1.0), 4)  # 2 x 3 turns x 4 steps x 1.02 s
    assert late["candidate"] == "fast" and late["skipped"].startswith("budget:")


def test_a_thorough_sweep_confirms_in_its_own_launch_what_the_steps_rule_picks(tmp_path):
    """A real two-rank launch: the worker's decision is the step's rule on the same figures, and the pick it
    confirms alternates with the reference in that launch."""
    from mfu_lab.steps.attention_comm.attention_race import _pick
    from mfu_lab.steps.attention_comm.comm_rows import comm_rows_of, config_of
    from mfu_lab.workers.comm_configs import config_name, sweep_configs

    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), comm_hooks=["none", "allreduce"],
                              comm_bucket_mb=[1, 25], comm_grad_as_bucket_view=[False], comm_steps=3,
                              comm_warmup_steps=1)
    spec = {"reference": "none/25MB/copy", "turns": 2, "deadline": None}
    # DDP's default made 40 ms slower per step (a test fault): some other configuration must clear it
    sweep = run_sweep(job, "cpu", None, tmp_path, allreduce=False, confirm=spec,
                      fault={"kind": "slow", "name": "none/25MB/copy", "ms": 40})
    assert len(sweep.launches) == 1 and sweep.launches[0]["finished"]
    # the step's own rule on the step's own rows (status, sync check and all), from the same events
    rows = comm_rows_of(sweep_configs(job), sweep, 1.0, 1.0, 2)
    good = [r for r in rows if r.status == "ok"]
    default = next(r for r in good if (r.hook, float(r.bucket_mb)) == ("none", 25.0))
    pick = config_name(config_of(_pick(good, default)))
    assert pick != "none/25MB/copy" and sweep.confirm["candidate"] == pick and sweep.confirm["done"]
    names = [config_name(ev["config"]) for ev in sweep.turns]
    assert names == ["none/25MB/copy", pick, pick, "none/25MB/copy"] and all(len(ev["wall_s"]) == 3
                                                                             for ev in sweep.turns)
    assert min(w for ev in sweep.turns if config_name(ev["config"]) == "none/25MB/copy"
               for w in ev["wall_s"]) >= 0.040  # the reference's turns carry its sleep
    c = comm_race.confirm_pick(job, "cpu", None, sweep, DEFAULT, dict(DEFAULT, hook=pick.split("/")[0],
                               bucket_mb=float(pick.split("/")[1][:-2])), tmp_path, Clock(None), 0.05)
    assert c.status == "ok" and c.proven and c.turns == 2  # taken from the sweep's launch, and the gain is real


def test_a_crash_in_a_confirmation_turn_keeps_every_measurement_and_confirms_in_a_launch_of_its_own(tmp_path):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), comm_hooks=["none", "allreduce"],
                              comm_bucket_mb=[1, 25], comm_grad_as_bucket_view=[False], comm_steps=3,
                              comm_warmup_steps=1)
    spec = {"reference": "none/25MB/copy", "turns": 2, "deadline": None}
    faults = [{"kind": "slow", "name": "none/25MB/copy", "ms": 40},
              {"kind": "crash", "config": 4, "rank": 1}]  # 4 configurations measured (0-3), then the first turn
    sweep = run_sweep(job, "cpu", None, tmp_path, allreduce=False, confirm=spec, fault=faults)
    assert all(ev["event"] == "done" for ev in sweep.outcomes.values()) and len(sweep.outcomes) == 4
    assert "error" in sweep.confirm and not sweep.confirm.get("done") and len(sweep.launches) == 1
    pick = sweep.confirm["candidate"]
    pick_cfg = dict(DEFAULT, hook=pick.split("/")[0], bucket_mb=float(pick.split("/")[1][:-2]))
    c = comm_race.confirm_pick(job, "cpu", None, sweep, DEFAULT, pick_cfg, tmp_path, Clock(None), 0.05)
    assert c.status == "ok" and c.order == ["none/25MB/copy", pick, pick, "none/25MB/copy", "none/25MB/copy",
                                            pick]  # its own launch, ABBA


def test_a_mode_that_leads_is_confirmed_inside_step_4_before_it_is_recommended(tmp_path, monkeypatch):
    """compile.run end to end (dynamo's eager backend, so it runs in seconds), with the rule made to pick 'default'
    as if it had led: the confirmation runs for real, and the recommendation follows what it measured."""
    from mfu_lab.steps.compile import step as compiled

    real = compiled._recommend

    def led(eager, trials, audit, recompiles):
        rec = real(eager, trials, audit, recompiles)
        if rec.get("compile"):
            return rec
        t = next(t for t in trials if t.mode == "default")
        return rec | {"compile": True, "mode": "default", "break_even_cold": 10.0,
                      "text": f"Compile with torch.compile(model, mode='default'): step {eager.step_median_s * 1e3:.1f}"
                              f" -> {t.step_median_s * 1e3:.1f} ms; pays for itself after 10 steps."}

    monkeypatch.setattr(compiled, "_recommend", led)
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), compile_backend="eager",
                              compile_modes=["default"])
    r = compiled.run(job, progress=lambda line: None, write=False)
    c = r.confirmation
    assert c is not None and c.status == "ok" and c.candidate == "default" and c.reference == "eager"
    assert c.order == ["eager", "default", "default", "eager", "eager", "default"]
    if c.proven:
        assert r.recommendation["compile"] and r.recommendation["mode"] == "default" and "stands" in \
            r.recommendation["text"]
    else:
        assert not r.recommendation["compile"] and r.recommendation["led"] == "default"
        assert r.recommendation["text"].startswith("Stay eager: mode default led (step ")
        assert "measured again beside eager" in r.recommendation["text"]
    assert compiled.CompileResult.from_dict(json.loads(json.dumps(jsonable(r)))).confirmation == c  # it round-trips
