"""loss_impl (issue 46): the default cross-entropy eager, compiled (alone, or with the forward as one region) or
chunked (F.linear_cross_entropy); the same loss each way, -100 padding kept, refusals that name the key, step 4's
race of them and the pick carried into tuned.yaml on its own rung."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from mfu_lab.analysis import tuning
from mfu_lab.analysis.result_keys import refusal
from mfu_lab.core.engine import losses
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.errors import JobError, StepError
from mfu_lab.core.job.schema import validate
from mfu_lab.steps.compile import loss_race

# F.linear_cross_entropy (torch 2.13+) behind 'chunked'; torch 2.11 (the GPU machine's) lacks it and refuses by name
NO_CHUNKED = losses.chunked_available()


def _batch(job, pad: int = 0):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(job.vocab_size, (job.micro_batch, job.seq_len), generator=g)
    y = torch.randint(job.vocab_size, (job.micro_batch, job.seq_len), generator=g)
    if pad:
        y[:, -pad:] = losses.IGNORE_INDEX
    return x, y


def _losses(job, impl: str, mode: str = "off", steps: int = 3, pad: int = 0) -> list[float]:
    j = dataclasses.replace(job, loss_impl=impl, compile_mode=mode)
    step = build_train_step(j, build_model(j).train(), "cpu")
    x, y = _batch(j, pad)
    return [float(step(x, y)) for _ in range(steps)]


@pytest.mark.parametrize("impl", ["compiled", "chunked"])
def test_each_impl_trains_the_same_loss_with_padding_ignored(tiny_job, impl):
    if impl == "chunked" and NO_CHUNKED:  # this torch cannot: the step refuses it, naming the key and the function
        with pytest.raises(StepError, match="loss_impl.*linear_cross_entropy"):
            _losses(tiny_job, impl, pad=7)
        return
    ref = _losses(tiny_job, "eager", pad=7)
    got = _losses(tiny_job, impl, pad=7)
    assert got == pytest.approx(ref, rel=1e-4)
    # the padded targets count for nothing: the loss of the first step is the mean over the others alone
    j = tiny_job
    x, y = _batch(j, 7)
    model = build_model(j)
    with torch.no_grad():
        logits = model(x)
    keep = y[:, :-7]
    manual = torch.nn.functional.cross_entropy(logits[:, :-7].reshape(-1, j.vocab_size), keep.reshape(-1))
    assert ref[0] == pytest.approx(float(manual), rel=1e-5)


def test_compiled_under_a_mode_is_one_region_with_the_forward(tiny_job):
    j = dataclasses.replace(tiny_job, loss_impl="compiled", compile_mode="default")
    step = build_train_step(j, build_model(j).train(), "cpu")
    assert step.compiled is None and step.region is not None  # not the model alone: forward and loss together
    eager_j = dataclasses.replace(tiny_job, loss_impl="eager", compile_mode="default")
    plain = build_train_step(eager_j, build_model(eager_j).train(), "cpu")
    assert plain.compiled is not None and plain.region is None
    assert _losses(tiny_job, "compiled", "default", 2) == pytest.approx(_losses(tiny_job, "eager", "default", 2),
                                                                         rel=1e-4)


def test_chunked_refuses_a_loss_factory_and_a_compiled_region_naming_the_key():
    with pytest.raises(JobError) as e:
        validate({"loss_impl": "chunked", "loss": "mymod:my_loss"}, "job.yaml")
    assert "loss_impl" in str(e.value) and "mymod:my_loss" in str(e.value)
    with pytest.raises(JobError) as e:
        validate({"loss_impl": "chunked", "compile_mode": "default"}, "job.yaml")
    assert "loss_impl" in str(e.value) and "compiled region" in str(e.value)
    with pytest.raises(JobError) as e:
        validate({"loss_impl": "fused"}, "job.yaml")
    assert "eager" in str(e.value) and "chunked" in str(e.value)


def test_chunked_on_a_model_without_an_lm_head_is_refused_by_name(tiny_job):
    class NoHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.out = nn.Linear(4, 4)

    assert ("linear_cross_entropy" if NO_CHUNKED else "lm_head") in losses.chunked_problem(NoHead())
    assert losses.chunked_problem(build_model(tiny_job)) == NO_CHUNKED  # None where this torch has the function
    j = dataclasses.replace(tiny_job, loss_impl="chunked")
    with pytest.raises(StepError, match="loss_impl"):
        build_train_step(j, NoHead(), "cpu")


@pytest.mark.skipif(bool(NO_CHUNKED), reason=f"{NO_CHUNKED} (the refusal: the tests above)")
def test_the_head_comes_back_after_a_chunked_step(tiny_job):
    j = dataclasses.replace(tiny_job, loss_impl="chunked")
    model = build_model(j).train()
    head = model.lm_head
    step = build_train_step(j, model, "cpu")
    step(*_batch(j))
    assert model.lm_head is head and head.weight is model.wte.weight  # tied, and trained through the loss


def test_the_race_candidates_follow_the_mode(tiny_job):
    names, missing = loss_race.candidates(tiny_job, "off", None)
    assert names == ["eager", "compiled", "chunked"] and missing == {}
    names, missing = loss_race.candidates(tiny_job, "default", None)
    assert names == ["eager", "compiled"] and "compiled region" in missing["chunked"]
    names, missing = loss_race.candidates(tiny_job, "off", "no lm_head here")
    assert names == ["eager", "compiled"] and missing == {"chunked": "no lm_head here"}


def test_nothing_to_race_is_said_not_raced(tiny_job):
    model = build_model(tiny_job)
    r = loss_race.race_loss(dataclasses.replace(tiny_job, loss="mymod:f"), "off", torch.device("cpu"), model, True,
                            None, 0.01, 1.0)
    assert r["ran"] is False and "own loss" in r["note"]
    r = loss_race.race_loss(tiny_job, "off", torch.device("cpu"), model, False, None, 0.01, 1.0)
    assert r["ran"] is False and "not token ids" in r["note"]
    r = loss_race.race_loss(tiny_job, "off", torch.device("cpu"), model, True, left_s=2.0, step_s=0.1, compile_s=5.0)
    assert r["ran"] is False and "set loss_impl by hand" in r["note"] and "1 compile(s)" in r["note"]


def test_step_4_keeps_the_loss_races_seconds_back_from_further_compile_modes(tiny_job):
    """The reservation is the race's own cost (key_race.cost_s) in the job's mode, at eager's step and one cold
    compile per compiled candidate; nothing is kept back where the race would not run."""
    from mfu_lab.core.engine.losses import chunked_problem
    from mfu_lab.steps.key_race import cost_s

    model = build_model(tiny_job)
    n = len(loss_race.candidates(tiny_job, "off", chunked_problem(model))[0])
    assert loss_race.reserve_s(tiny_job, model, True, 0.25, 20.0) == pytest.approx(cost_s(n, 0.25, 20.0))
    compiled = dataclasses.replace(tiny_job, compile_mode="default")  # both candidates compiled: two compiles
    assert loss_race.reserve_s(compiled, model, True, 0.25, 20.0) == pytest.approx(cost_s(2, 0.25, 40.0))
    assert loss_race.reserve_s(dataclasses.replace(tiny_job, loss="mymod:f"), model, True, 0.25, 20.0) == 0.0
    assert loss_race.reserve_s(tiny_job, model, False, 0.25, 20.0) == 0.0


def test_the_race_times_each_impl_and_keeps_the_loss(tiny_job):
    said = []
    r = loss_race.race_loss(tiny_job, "off", torch.device("cpu"), build_model(tiny_job), True, None, 0.01, 1.0,
                            said.append)
    impls = ["eager", "compiled"] + ([] if NO_CHUNKED else ["chunked"])  # chunked raced where this torch has it
    assert r["ran"] is True and [x["loss_impl"] for x in r["rows"]] == impls
    sp = r["speedup"]
    assert sp["low"] <= sp["value"] <= sp["high"]
    assert r["adopted"] == (r["pick"] != "eager" and sp["low"] > 1.0 and r["final_gap"] <= tiny_job.loss_tolerance)
    finals = [x["final_loss"] for x in r["rows"]]
    assert max(finals) - min(finals) < 1e-3 * abs(finals[0])  # the same loss, trained three ways
    assert any("loss race round" in m for m in said)


def _race(adopted: bool, low: float) -> dict:
    return {"loss_race": {"ran": True, "adopted": adopted, "pick": "compiled", "reference": "eager", "mode": "off",
                          "speedup": {"value": 1.2, "low": low, "high": 1.3}, "final_gap": 0.0001}}


def test_an_adopted_pick_reaches_the_tuned_job_on_its_own_rung(tiny_job):
    chosen = tuning.changes(tiny_job, {"compile": _race(True, 1.05)})
    assert [(c.rung, c.key, c.new, c.label) for c in chosen] == [("loss", "loss_impl", "compiled", "measured")]
    assert "1.20x [1.05, 1.30]" in chosen[0].evidence
    stairs = tuning.staircase(tiny_job, chosen)
    assert [name for name, _, _ in stairs] == ["original", "loss"] and stairs[1][1].loss_impl == "compiled"
    assert tuning.changes(tiny_job, {"compile": _race(False, 0.95)}) == []
    assert refusal("loss", "loss_impl", "chunked") is None
    assert refusal("loss", "compile_mode", "default") is not None  # its row owns loss_impl only
    assert refusal("loss", "loss_impl", "fused") is not None  # not one of the allowed values


def _leader_and_chunked(confirmed: bool) -> dict:
    """Step 4's result: mode default led its trials (confirmed or not beside eager), and the loss race, run in the
    mode the job trains in after step 4, picked chunked (a suite run's own pair: 1.31x unconfirmed, chunked 1.09x)."""
    rec = {"compile": True, "mode": "default"} if confirmed else {"compile": False, "led": "default"}
    race = {"ran": True, "adopted": True, "pick": "chunked", "reference": "eager", "mode": "off",
            "speedup": {"value": 1.09, "low": 1.005, "high": 1.13}, "final_gap": 0.0}
    return {"recommendation": rec, "trials": [{"mode": "default", "speedup": 1.31}], "loss_race": race}


@pytest.mark.parametrize("confirmed", [False, True])
def test_a_pair_the_job_refuses_never_reaches_the_tuned_job(tiny_job, confirmed):
    """A compile mode beside loss_impl chunked is a job the validator refuses (step 7 failed on it): the proposed
    change gives way to the measured one, and of two measured ones the later rung (the loss's race ran eager)."""
    chosen = tuning.changes(tiny_job, {"compile": _leader_and_chunked(confirmed)})
    by_key = {c.key: c for c in chosen}
    assert set(by_key) == {"compile_mode", "loss_impl"}
    kept, dropped = ("compile_mode", "loss_impl") if confirmed else ("loss_impl", "compile_mode")
    assert by_key[kept].adopted and not by_key[dropped].adopted
    assert by_key[dropped].reason.startswith(tuning.CLASH_REASON)
    assert f"beside {kept}: {by_key[kept].new} ({by_key[kept].label})" in by_key[dropped].reason
    assert "chunked does not combine with a compiled region" in by_key[dropped].reason
    tuned = tuning.tuned_job(tiny_job, chosen)  # valid: it raises otherwise
    assert getattr(tuned, kept) == by_key[kept].new and getattr(tuned, dropped) == getattr(tiny_job, dropped)


def test_any_other_refused_combination_leaves_out_the_change_the_validator_names(tiny_job):
    assert not tiny_job.activation_checkpointing
    chosen = [tuning.Change("batch", "kernels", "checkpoint_policy", "full", "selective", "e", "measured"),
              tuning.Change("loss", "compile", "loss_impl", "eager", "compiled", "e", "measured")]
    out = tuning.combinable(tiny_job, chosen)
    assert [c.adopted for c in out] == [False, True]
    assert "checkpoint_policy" in out[0].reason and "activation_checkpointing: true" in out[0].reason
    assert tuning.tuned_job(tiny_job, out).loss_impl == "compiled"


def test_a_rung_the_job_refuses_alone_is_climbed_after_the_rung_that_mends_it(tiny_job):
    """A job already on loss_impl chunked (a tuned.yaml run again): step 4 confirms mode default and its loss race,
    in that mode, picks compiled. The tuned job is valid, but its compile rung on the original (default beside
    chunked) is not: the staircase climbs the loss rung first, then compile, each rung its own change."""
    job = dataclasses.replace(tiny_job, loss_impl="chunked")
    race = {"ran": True, "adopted": True, "pick": "compiled", "reference": "chunked", "mode": "default",
            "speedup": {"value": 1.4, "low": 1.2, "high": 1.6}, "final_gap": 0.0}
    step4 = {"recommendation": {"compile": True, "mode": "default"}, "trials": [{"mode": "default", "speedup": 1.3}],
             "loss_race": race}
    chosen = tuning.changes(job, {"compile": step4})
    assert [(c.key, c.new, c.adopted) for c in chosen] == [("compile_mode", "default", True),
                                                           ("loss_impl", "compiled", True)]
    stairs = tuning.staircase(job, chosen)
    assert [(name, [c.key for c in mine]) for name, _, mine in stairs] == [
        ("original", []), ("loss", ["loss_impl"]), ("compile", ["compile_mode"])]
    assert [(j.compile_mode, j.loss_impl) for _, j, _ in stairs] == [("off", "chunked"), ("off", "compiled"),
                                                                      ("default", "compiled")]
