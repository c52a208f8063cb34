"""Issue 29, item 3: step 2 races FSDP2 candidates beside DDP's configurations (keys, race, loss check)."""

import dataclasses

import pytest

from mfu_lab.analysis.dp_family import loss_gap, loss_verdict
from mfu_lab.core.job.schema import JobError, load_job, validate
from mfu_lab.workers.comm_configs import config_key, config_name, fsdp_configs, is_fsdp, sweep_configs

TINY = "tests/data/tiny.yaml"


def _problems(values):
    with pytest.raises(JobError) as e:
        validate(values, "test")
    return {p.key: p.expected for p in e.value.problems}


def test_the_fsdp_candidate_keys_default_to_eight_candidates_and_all_empty_turns_them_off():
    job = validate({}, "test")
    assert (job.comm_fsdp_reshard, job.comm_fsdp_prefetch, job.comm_fsdp_reduce_dtype) == (
        [True, False], [0, 1], ["float32", "bfloat16"])
    fsdp = [c for c in sweep_configs(job) if is_fsdp(c)]
    assert len(fsdp) == 8 and len({config_key(c) for c in sweep_configs(job)}) == len(sweep_configs(job))
    assert "fsdp reshard=true prefetch=1 reduce=bfloat16" in {config_name(c) for c in fsdp}
    off = validate({"comm_fsdp_reshard": [], "comm_fsdp_prefetch": [], "comm_fsdp_reduce_dtype": []}, "test")
    assert fsdp_configs(off) == [] and all(not is_fsdp(c) for c in sweep_configs(off))


def test_bad_fsdp_candidate_values_are_refused_naming_the_key_and_the_allowed_values():
    why = _problems({"comm_fsdp_reduce_dtype": ["float8"], "comm_fsdp_prefetch": [-1], "comm_fsdp_reshard": ["yes"]})
    assert "float32, bfloat16, float16" in why["comm_fsdp_reduce_dtype"] and "float8" in why["comm_fsdp_reduce_dtype"]
    assert ">= 0" in why["comm_fsdp_prefetch"]
    assert "true or false" in why["comm_fsdp_reshard"]
    why = _problems({"comm_fsdp_prefetch": []})  # one empty list alone would drop every candidate silently
    assert set(why) == {"comm_fsdp_prefetch"} and "all three" in why["comm_fsdp_prefetch"]


def test_a_lossy_reduce_dtype_is_adopted_only_within_loss_tolerance():
    bf16 = {"kind": "fsdp", "reshard": True, "prefetch": 0, "reduce_dtype": "bfloat16"}
    fp32 = dict(bf16, reduce_dtype="float32")
    assert loss_gap(5.1, 5.0) == pytest.approx(0.02)
    assert loss_verdict(bf16, 5.05, 5.0, 0.02) == (True, "")  # 1% from the reference's loss
    fine, why = loss_verdict(bf16, 5.2, 5.0, 0.02)  # 4%: outside
    assert not fine and "loss_tolerance 2%" in why
    assert not loss_verdict(bf16, None, 5.0, 0.02)[0]  # lossy and never compared: never adopted
    assert loss_verdict(fp32, None, 5.0, 0.02)[0]


def test_the_step_does_not_pick_a_faster_bfloat16_candidate_outside_loss_tolerance():
    from mfu_lab.steps.attention_comm.attention_race import _pick
    from mfu_lab.steps.attention_comm.comm_rows import CommRow, loss_check

    default = CommRow("none", 25.0, False, "ok", step_median_s=1.0, step_p10_s=0.98, step_p90_s=1.02, loss=5.0)
    fast = CommRow("fsdp reshard=true prefetch=0 reduce=bfloat16", 0.0, False, "ok", step_median_s=0.5,
                   step_p10_s=0.49, step_p90_s=0.51, kind="fsdp", loss=5.5,
                   fsdp={"reshard": True, "prefetch": 0, "reduce_dtype": "bfloat16"})
    ok = CommRow("fsdp reshard=true prefetch=0 reduce=float32", 0.0, False, "ok", step_median_s=0.8,
                 step_p10_s=0.79, step_p90_s=0.81, kind="fsdp", loss=5.0,
                 fsdp={"reshard": True, "prefetch": 0, "reduce_dtype": "float32"})
    pick = _pick(loss_check([default, fast, ok], default, 0.02), default)
    assert pick is ok and fast.loss_note and fast.loss_gap == pytest.approx(0.1)
    fast.loss = 5.01  # within the tolerance: the fastest is taken
    assert _pick(loss_check([default, fast, ok], default, 0.02), default) is fast


@pytest.mark.e2e
def test_step_2_races_fsdp2_candidates_at_world_2_with_confirmation_andloss_check(tmp_path):
    """A real two-rank race: DDP's default (made 150 ms slower per step, a test fault) against FSDP2 candidates;
    the pick is one whose loss is within tolerance, confirmed beside the default in the same launch."""
    from mfu_lab.core.process.budget import Clock
    from mfu_lab.steps.attention_comm import comm_race
    from mfu_lab.steps.attention_comm.attention_race import _pick
    from mfu_lab.steps.attention_comm.comm_rows import comm_rows_of, config_of, loss_check

    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), comm_hooks=["none"], comm_bucket_mb=[25],
                              comm_grad_as_bucket_view=[False], comm_steps=2, comm_warmup_steps=1,
                              comm_fsdp_reshard=[True, False], comm_fsdp_prefetch=[1],
                              comm_fsdp_reduce_dtype=["float32", "bfloat16"], comm_screen="product")
    sweep, log, configs = comm_race.race_ddp(job, "cpu", None, tmp_path, lambda ev: None, grad_bytes=1 << 16,
                                             reference=("none", 25.0, False), clock=Clock(None),
                                             fault={"kind": "slow", "name": "none/25MB/copy", "ms": 150})
    assert len(configs) == 5 and sum(is_fsdp(c) for c in configs) == 4
    assert len(sweep.launches) == 1 and sweep.launches[0]["finished"]
    screened = log.rounds[0]
    assert set(screened.medians) == {config_name(c) for c in configs}  # every FSDP2 candidate raced
    rows = comm_rows_of(configs, sweep, 1.0, 1.0, 2)
    fsdp_done = [r for r in rows if r.kind == "fsdp" and r.status == "ok"]
    assert fsdp_done and all(r.loss is not None and r.comm_s > 0 and r.no_sync_step_s for r in fsdp_done)
    default = next(r for r in rows if r.hook == "none")
    good = loss_check([r for r in rows if r.status == "ok"], default, job.loss_tolerance)
    pick = _pick(good, default)
    assert pick.kind == "fsdp" and pick.loss_gap <= job.loss_tolerance
    assert sweep.confirm["candidate"] == config_name(config_of(pick)) and sweep.confirm["done"]
    assert [config_name(ev["config"]) for ev in sweep.turns].count(config_name(config_of(pick))) == 3


def test_an_fsdp_pick_is_not_taken_for_a_ddp_configuration_by_steps_3_and_6(tmp_path):
    import json

    from mfu_lab.analysis.placement.calibration import recommended_comm
    from mfu_lab.steps.kernels import step as kernels

    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    name = "fsdp reshard=true prefetch=1 reduce=float32"
    rec = {"kind": "fsdp", "hook": name, "bucket_cap_mb": 0.0, "gradient_as_bucket_view": False,
           "job_keys": {"dp_mode": "fsdp"}}
    rows = [{"hook": "none", "bucket_mb": 25.0, "grad_as_bucket_view": False, "status": "ok"},
            {"hook": name, "bucket_mb": 0.0, "grad_as_bucket_view": False, "status": "ok", "kind": "fsdp"}]
    folder = job.step_dir("02_attention_and_comm")
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"recommendation": {"comm": rec}}))
    cfg, why = kernels._comm_config(job)  # step 3 profiles DDP as the job has it
    assert cfg == {"hook": "none", "bucket_mb": 25.0, "grad_as_bucket_view": False} and "FSDP2" in why
    assert recommended_comm({"recommendation": {"comm": rec}, "comm": rows}) is rows[0]  # step 6: DDP's figures
