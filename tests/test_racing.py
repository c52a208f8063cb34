"""Issue 20: racing sweeps, the budget and --thorough, on hand-made timings and stand-in launches (no torchrun)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from mfu_lab.analysis import racing
from mfu_lab.commands.common import cost_overrides
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.process import budget, floors
from mfu_lab.core.process.budget import Clock
from mfu_lab.steps.attention_comm import comm_race
from mfu_lab.workers import comm_configs
from mfu_lab.workers.comm_configs import config_key, factor_configs, is_fsdp, known_refusal, screened_configs
from mfu_lab.workers.launch import SweepOutcome

from .conftest import TINY


def test_a_clear_winner_leaves_only_itself_and_the_references():
    samples = {"fast": [1.00, 1.01], "slow": [1.50, 1.52], "slower": [2.0, 2.1], "default": [1.40, 1.45]}
    kept, dropped = racing.survivors(samples, ["default"])
    assert kept == ["fast", "default"]
    assert set(dropped) == {"slow", "slower"} and "outside the leader's noise band" in dropped["slow"]


def test_two_candidates_inside_each_others_noise_both_reach_the_final_round():
    samples = {"a": [1.00, 1.10], "b": [1.05, 1.08], "c": [3.0, 3.1]}
    kept, dropped = racing.survivors(samples, [])
    assert kept == ["a", "b"] and list(dropped) == ["c"]


def test_references_are_never_dropped_however_slow():
    samples = {f"c{i}": [1.0 + i / 1000, 1.001 + i / 1000] for i in range(9)} | {"ddp default": [9.0, 9.5]}
    kept, dropped = racing.survivors(samples, ["ddp default", "job's own"])
    assert "ddp default" in kept and "ddp default" not in dropped
    assert "job's own" not in kept  # not a candidate here (no samples): the caller records why
    # a flat field still shrinks: a third of the 10 candidates (4) go on, the rest are a toss-up with them
    assert len(kept) == 4 + 1 and all("not among the best 4 of 10" in why for why in dropped.values())
    many = {f"c{i}": [1.0, 1.001] for i in range(40)}
    assert len(racing.survivors(many, [])[0]) == 4  # at most four finalists, however large the field


def test_known_refusals_are_recorded_without_a_launch(tmp_path, monkeypatch):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), comm_hooks=["none", "bf16_compress", "powersgd"],
                              comm_bucket_mb=[1, 25], comm_grad_as_bucket_view=[False], comm_screen="product")
    launched = []

    def fake_sweep(job, device_type, attention, work, progress=None, configs=None, screen=0, allreduce=True, **kw):
        launched.append(([config_key(c) for c in configs], screen))
        out = SweepOutcome({"world_size": 2}, [])
        for i, c in enumerate(configs):
            wall = [0.1 + 0.01 * i, 0.1 + 0.01 * i]
            out.outcomes[config_key(c)] = {"event": "done", "config": c, "wall_s": wall, "screen": bool(screen)}
            if screen:  # as run_sweep keeps a screening's events (this stand-in's worker races no final round)
                out.screened[config_key(c)] = out.outcomes[config_key(c)]
        return out

    monkeypatch.setattr(comm_race, "run_sweep", fake_sweep)
    monkeypatch.setattr(comm_configs, "bf16_hook_allowed", lambda: False)  # a CPU build of torch, as on CI
    seen = []
    sweep, log, configs = comm_race.race_ddp(job, "cpu", None, tmp_path, seen.append, grad_bytes=8 << 20,
                                             reference=("none", 25.0, False), clock=Clock(None))
    every = {k for keys, _ in launched for k in keys}
    assert ("bf16_compress", 1.0, False) not in every and ("bf16_compress", 25.0, False) not in every
    assert ("powersgd", 1.0, False) not in every  # 8 MB of gradients in 1 MB buckets: more than one bucket
    assert ("powersgd", 25.0, False) in every  # one bucket: tried
    refused = sweep.outcomes[("bf16_compress", 1.0, False)]
    assert refused["event"] == "unsupported" and "NCCL" in refused["error"] and refused in seen
    assert known_refusal({"hook": "bf16_compress", "bucket_mb": 25, "grad_as_bucket_view": False}, "nccl", 1) is None
    assert [s for _, s in launched] == [job.race_steps, 0]  # a screening launch, then the final one
    assert log.mode == "racing" and "none/25MB/copy" in log.rounds[0].kept


def test_the_bf16_hook_is_refused_on_gloo_only_where_torchs_own_check_refuses_it(monkeypatch):
    bf16 = {"hook": "bf16_compress", "bucket_mb": 25, "grad_as_bucket_view": False}
    monkeypatch.setattr(comm_configs, "bf16_hook_allowed", lambda: True)  # a CUDA build (2.11+cu130 runs it on gloo)
    assert known_refusal(bf16, "gloo", 1) is None
    monkeypatch.setattr(comm_configs, "bf16_hook_allowed", lambda: False)
    assert "NCCL 2.10+" in known_refusal(bf16, "gloo", 1)
    monkeypatch.undo()
    import torch
    # this build's own answer follows torch's condition: a CPU build (no torch.version.cuda) never allows it
    if torch.version.cuda is None and torch.version.hip is None:
        assert comm_configs.bf16_hook_allowed() is False


def _changed(a: dict, b: dict) -> set:
    return {k for k in a if a[k] != b[k]}


def test_the_factor_screen_varies_one_knob_at_a_time_from_the_jobs_own_settings(tmp_path, monkeypatch):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), ddp_hook="fp16_compress", ddp_bucket_mb=8.0,
                              comm_hooks=["none", "allreduce", "fp16_compress", "powersgd"], comm_bucket_mb=[1, 8, 25],
                              comm_grad_as_bucket_view=[False, True], comm_fsdp_reshard=[True, False],
                              comm_fsdp_prefetch=[0, 1], comm_fsdp_reduce_dtype=["float32", "bfloat16"],
                              fsdp_prefetch=1)
    own = comm_race.job_config(job)
    configs = factor_configs(job, own)
    ddp, fsdp = [c for c in configs if not is_fsdp(c)], [c for c in configs if is_fsdp(c)]
    assert ddp[0] == own and all(len(_changed(c, own)) == 1 for c in ddp[1:])
    assert len(ddp) == 1 + 3 + 2 + 1  # the other hooks, the other bucket sizes, the view flipped
    assert {c["hook"] for c in ddp} == set(job.comm_hooks) and {c["bucket_mb"] for c in ddp} == {1, 8, 25}
    base = {"kind": "fsdp", "reshard": True, "prefetch": 1, "reduce_dtype": "float32"}  # the job's own fsdp_* keys
    assert fsdp[0] == base and len(fsdp) == 4 and all(len(_changed(c, base)) == 1 for c in fsdp[1:])
    assert len({config_key(c) for c in configs}) == len(configs)
    product = dataclasses.replace(job, comm_screen="product")
    assert len(screened_configs(product, own)) == 4 * 3 * 2 + 8  # the own configuration is one of them
    assert len(screened_configs(dataclasses.replace(job, thorough=True), own)) == 4 * 3 * 2 + 8
    off = dataclasses.replace(job, comm_fsdp_reshard=[], comm_fsdp_prefetch=[], comm_fsdp_reduce_dtype=[])
    assert not any(is_fsdp(c) for c in factor_configs(off, own))

    launched = []

    def fake_sweep(job, device_type, attention, work, progress=None, configs=None, screen=0, allreduce=True, **kw):
        launched.append([config_key(c) for c in configs])
        return SweepOutcome({"world_size": 2}, [])

    monkeypatch.setattr(comm_race, "run_sweep", fake_sweep)
    _, _, listed = comm_race.race_ddp(job, "cpu", None, tmp_path, lambda ev: None, grad_bytes=1 << 10,
                                      reference=("none", 25.0, False), clock=Clock(None))
    assert [config_key(c) for c in listed] == [config_key(c) for c in configs]  # the screen is what step 2 races
    assert set(launched[0]) <= {config_key(c) for c in configs}


def test_thorough_runs_every_configuration_in_full_in_one_launch(tmp_path, monkeypatch):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), thorough=True)
    launched = []

    def fake_sweep(job, device_type, attention, work, progress=None, configs=None, screen=0, allreduce=True, **kw):
        launched.append((len(configs), screen))
        return SweepOutcome({"world_size": 2}, [])

    monkeypatch.setattr(comm_race, "run_sweep", fake_sweep)
    _, log, configs = comm_race.race_ddp(job, "cpu", None, tmp_path, lambda ev: None, grad_bytes=1 << 10,
                                         reference=("none", 25.0, False), clock=Clock(None))
    runnable = [c for c in configs if not known_refusal(c, "gloo", 1 << 10)]
    assert launched == [(len(runnable), 0)] and log.mode == "exhaustive"


def test_a_budget_too_small_for_the_final_round_keeps_the_leader_and_the_references_and_says_so(tmp_path,
                                                                                                 monkeypatch):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), comm_hooks=["none", "allreduce"],
                              comm_bucket_mb=[1, 8, 25], comm_grad_as_bucket_view=[False, True])
    finals = []

    def fake_sweep(job, device_type, attention, work, progress=None, configs=None, screen=0, allreduce=True, **kw):
        if not screen:
            finals.append([config_key(c) for c in configs])
        out = SweepOutcome({"world_size": 2}, [])
        for c in configs:  # a flat field: everything inside the leader's noise
            out.outcomes[config_key(c)] = {"event": "done", "config": c, "wall_s": [0.100, 0.101],
                                           "screen": bool(screen)}
            if screen:
                out.screened[config_key(c)] = out.outcomes[config_key(c)]
        return out

    monkeypatch.setattr(comm_race, "run_sweep", fake_sweep)
    # the first round screens everything here (its own cut: test_budget_steps); nothing left: the final round shrinks
    monkeypatch.setattr(comm_race, "screen_fit", lambda job, runnable, refs, clock: (runnable, []))
    clock = Clock(planned_s=0.0)
    sweep, log, _ = comm_race.race_ddp(job, "cpu", None, tmp_path, lambda ev: None, grad_bytes=1 << 10,
                                       reference=("none", 25.0, False), clock=clock)
    assert len(finals[0]) == 2 and ("none", 25.0, False) in finals[0]  # the leader and DDP's default
    assert clock.shortened and clock.shortened[0]["reason"].startswith("budget:")
    assert any(ev["event"] == "dropped" and ev["error"].startswith("budget:") for ev in sweep.outcomes.values())


def test_the_budget_divides_time_by_the_stated_weights():
    p = budget.plan(10)
    work = 600 - 7 * budget.STEP_OVERHEAD_S  # each of the seven notebooks' own cost comes off the top
    assert sum(p.values()) == pytest.approx(work)
    total = sum(budget.WEIGHTS.values())
    assert p["attention_comm"] == pytest.approx(work * 121 / total)
    assert p["baseline"] == pytest.approx(work * 16 / total)
    assert budget.plan(1) == dict.fromkeys(budget.WEIGHTS, 0.0)  # 60 s hold no step's work beside the notebooks
    assert budget.plan(floors.budget_for("baseline", p["baseline"]))["baseline"] >= p["baseline"]  # the inverse
    assert budget.plan(0) == {} and Clock.for_step(load_job(TINY), "compile").planned_s is None
    line = budget.plan_text(10, ["baseline", "compile"], {"baseline": 1, "compile": 4})
    assert "step 1 " in line and "step 4 " in line and "step 2" not in line


def test_budget_and_thorough_on_the_command_line_set_their_job_keys():
    assert cost_overrides(argparse.Namespace(budget=5.0, thorough=True), {}) == {"budget_min": 5.0, "thorough": True}
    with pytest.raises(JobError, match="--budget"):
        cost_overrides(argparse.Namespace(budget=-1.0, thorough=False), {})


def test_configurations_the_budget_left_out_take_the_bounds_reason_when_the_worker_found_one(tmp_path, monkeypatch):
    """The budget screens DDP's default alone; its launch then finds communication hidden (the worker's bound): the
    DDP configurations left out say so with the measured reason, the FSDP2 ones keep the budget's, and the note
    counts them."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), comm_hooks=["none", "allreduce"],
                              comm_bucket_mb=[1, 25], comm_grad_as_bucket_view=[False], comm_fsdp_reshard=[True],
                              comm_fsdp_prefetch=[0],
                              comm_fsdp_reduce_dtype=["float32"])
    bound = "cannot be faster here: (figures)"

    def fake_sweep(job, device_type, attention, work, progress=None, configs=None, screen=0, allreduce=True, **kw):
        out = SweepOutcome({"world_size": 2}, [])
        for c in configs:  # the references only: the budget kept nothing else
            out.outcomes[config_key(c)] = {"event": "done", "config": c, "wall_s": [0.1, 0.1, 0.1],
                                           "no_sync_wall_s": [0.1, 0.1, 0.1]}
        out.rounds = [{"event": "round", "number": 1, "kept": [comm_race.name(c) for c in configs], "dropped": {},
                       "cut": [], "seconds": 1.0, "bound": bound}]
        return out

    monkeypatch.setattr(comm_race, "run_sweep", fake_sweep)
    monkeypatch.setattr(comm_race, "job_step_s", lambda data: (5.0, "a 5 s step (test)"))
    seen = []
    sweep, log, configs = comm_race.race_ddp(job, "cpu", None, tmp_path, seen.append, grad_bytes=1 << 10,
                                             reference=("none", 25.0, False), clock=Clock(12.0))
    left_out = {comm_race.name(c): sweep.outcomes[config_key(c)] for c in configs[1:]}
    assert len(left_out) == 3 and all(ev["event"] == "skipped" for ev in left_out.values())
    for name, ev in left_out.items():
        if "fsdp" in name:
            assert ev["error"].startswith("budget: not screened")
        else:
            assert ev["error"] == f"{bound}; the budget left it out as well"
    assert log.note == f"2 DDP configuration(s) not screened: {bound}"


def test_the_race_plot_counts_only_the_candidates_that_ran_in_a_round():
    """A DDP configuration the exposure bound ruled out has no median in round 1: drawn as nothing, not counted."""
    from types import SimpleNamespace

    from mfu_lab.plots.attention_comm import race

    log = racing.RaceLog("racing", ["ref"], [racing.RoundLog(1, 2, {"ref": 0.10, "a": 0.12, "ruled": None},
                                                             ["ref"], {"a": "slow", "ruled": "cannot be faster"}),
                                             racing.RoundLog(2, 3, {"ref": 0.10}, ["ref"])])
    fig = race(SimpleNamespace(races={"ddp": log}))
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["round 1\n2 steps, 2 ran", "round 2\n3 steps, 1 ran"]


def test_the_final_rounds_estimate_leaves_out_what_was_measured_in_full_already():
    """The references go first, in full: their samples count in the noise band, but the final round does not
    measure them again, so the budget's estimate is the screened candidates' seconds x full_factor per finalist
    still to measure."""
    samples = {"ref": [1.0, 1.0, 1.0], "a": [1.0, 1.01], "b": [1.0, 1.02], "c": [3.0, 3.1]}
    # 3 screened in 3 s: 1 s each, x2 for a full measurement; a, b and ref kept, a and b still to measure: 4 s
    kept, _, cut = racing.finalists(samples, ["ref"], 3.0, 2.0, 4.5, measured={"ref"})
    assert set(kept) == {"a", "b", "ref"} and cut == []
    kept, _, cut = racing.finalists(samples, ["ref"], 3.0, 2.0, 3.5, measured={"ref"})
    assert cut and "ref" in kept
    # without ``measured`` the reference counts as screened and measured again: 0.75 s x 2 x 3 = 4.5 s > 4.4
    assert racing.finalists(samples, ["ref"], 3.0, 2.0, 4.4)[2]
    assert not racing.finalists(samples, ["ref"], 3.0, 2.0, 4.4, measured={"ref"})[2]
