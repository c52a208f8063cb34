"""benchmarks/gpu_check.py's plain parts, on a CPU: --steps, the world-size and time guards, the table, and the
run loop with its GPU steps replaced (a failure recorded, a step skipped for time, the table printed last)."""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check as gc  # noqa: E402
import gpu_check_table as t  # noqa: E402

from mfu_lab.core.job.schema import load_job, validate  # noqa: E402


# ---------------------------------------------------------------------- --steps
def test_steps_parse_in_run_order_once_each():
    assert t.parse_steps("baseline, monitor,baseline") == ["monitor", "baseline"]
    assert t.parse_steps("verify,fp8,kernels") == ["kernels", "fp8", "verify"]
    assert t.parse_steps("all") == list(t.STEPS)
    assert t.parse_steps(",".join(t.STEPS)) == list(t.STEPS)


def test_steps_typo_names_allowed_values_and_a_suggestion():
    with pytest.raises(t.StepsError) as e:
        t.parse_steps("monitor,basline")
    msg = str(e.value)
    assert "unknown step 'basline'" in msg and "did you mean 'baseline'?" in msg
    assert "allowed: " + ", ".join(t.STEPS) in msg
    with pytest.raises(t.StepsError, match="allowed"):
        t.parse_steps(" , ")
    with pytest.raises(t.StepsError) as e:
        t.parse_steps("zzzz")
    assert "did you mean" not in str(e.value) and "allowed" in str(e.value)


def test_steps_argument_and_aliases(capsys):
    assert gc.parse_args([]).steps == list(t.DEFAULT_STEPS) == [s for s in t.STEPS if s != "layouts"]
    assert gc.parse_args(["--steps", "layouts"]).steps == ["layouts"]  # a call of its own
    assert gc.parse_args(["--steps", "fp8,compile"]).steps == ["compile", "fp8"]
    assert gc.parse_args(["--quick"]).steps == ["baseline"]
    assert gc.parse_args(["--monitor-only"]).steps == ["monitor"]
    assert "verify" not in gc.parse_args(["--skip-verify"]).steps
    assert gc.parse_args(["--steps", "verify", "--skip-verify"]).steps == []
    args = gc.parse_args(["--out", "x", "--limit-s", "100"])
    assert args.out.is_absolute() and args.limit_s == 100
    with pytest.raises(SystemExit) as e:
        gc.parse_args(["--steps", "kernals"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "did you mean 'kernels'?" in err and "allowed: monitor, baseline" in err
    with pytest.raises(SystemExit):
        gc.parse_args(["--quick", "--steps", "baseline"])  # one way of choosing at a time


# ---------------------------------------------------------------------- the guards
@pytest.mark.parametrize("visible, requested, chosen, capped", [
    (1, 0, 1, False), (2, 0, 2, False), (8, 0, 8, False), (4, 2, 2, False),
    (16, 0, 2, True), (16, 4, 2, True), (2, 8, 2, True), (1, 4, 1, True), (4, 8, 2, True)])
def test_world_guard(visible, requested, chosen, capped):
    n, msg = t.world_guard(visible, requested)
    assert n == chosen and n <= visible
    assert ("capped at" in msg) == capped
    if capped:
        assert "two ranks suffice" in msg


def test_world_guard_needs_a_gpu():
    with pytest.raises(ValueError):
        t.world_guard(0, 0)


def test_time_guard():
    assert t.time_guard(100.0, 560.0, 50.0) == ""
    assert t.time_guard(510.0, 560.0, 50.0) == ""  # ends exactly at the limit
    why = t.time_guard(530.0, 560.0, 50.0)
    assert why.startswith("time") and "30 s left" in why and "~50 s" in why
    assert "0 s left" in t.time_guard(600.0, 560.0, 1.0)


def test_estimates_and_pace():
    assert t.pace([], []) == 1.0
    assert t.pace([10.0], [15.0]) == 1.5
    assert t.pace([10.0], [100.0]) == t.PACE_RANGE[1]
    assert t.pace([10.0], [1.0]) == t.PACE_RANGE[0]
    assert t.estimate_s("attention_comm", 2) > t.estimate_s("attention_comm", 1)
    assert t.estimate_s("baseline", 2) == t.estimate_s("baseline", 1)
    # each part fits one call as estimated (the default runs them in order, the time guard skipping what no longer
    # fits, so the riskiest paths come first)
    assert all(sum(t.estimate_s(s, 1) for s in part) < 560 for part in t.PARTS.values())
    assert list(t.DEFAULT_STEPS[:len(t.PARTS[1])]) == list(t.PARTS[1])
    assert t.estimate_s("layouts", 8) < 560  # the layouts part fits a call of its own


# ---------------------------------------------------------------------- the table
def test_figure_rows():
    assert t.figure_row("step 1", "x", 0.0123, "{:.1%}", "of {peak}").value == "1.2% of {peak}"
    assert t.figure_row("step 1", "x", 3, "{} rungs").status == "pass"
    for bad in (None, math.nan, math.inf, "3", True):
        r = t.figure_row("step 1", "x", bad, "{:.1f}")
        assert r.status == "fail" and r.value.startswith("missing")
    assert t.figure_row("step 1", "x", 1.0, ok=False).status == "fail"
    assert t.skip_row("step 2", "y", "one GPU\nmore").status == "skip: one GPU"
    r = t.fail_row("step 3", "z", RuntimeError("first line\nsecond line"))
    assert (r.status, r.value) == ("fail", "RuntimeError: first line")


def test_step_5s_fp8_speed_row_passes_a_measured_slower_and_fails_only_what_went_wrong():
    """The per-group gate (issue 46) makes 'slower' a measured outcome: at d_model 768 float8 measured 0.70x of
    bf16 on the first H200 run, so the small job may well drop every group. That row passes with the probe's
    figures; it used to fall through to a failure and the check's exit code 1."""
    probe = [{"group": "mlp", "in": 768, "out": 3072, "speedup": 0.70}, {"group": "attn", "in": 768, "out": 2304}]
    r = t.fp8_speed_row("step 5", "fp8", {"status": "slower", "group_probe": probe, "reason": "r"}, (9, 0))
    assert r.status == "pass" and r.label == "measured" and "mlp 768x3072 0.70x" in r.value and "attn" not in r.value
    assert t.fp8_speed_row("step 5", "fp8", {"status": "slower", "group_probe": []}, (9, 0)).status == "fail"
    ok = t.fp8_speed_row("step 5", "fp8", {"status": "ok", "speedup": 1.21, "bf16_step_s": 0.05, "fp8_step_s": 0.04},
                         (9, 0))
    assert ok.status == "pass" and ok.value.startswith("1.21x bf16 (50.00 -> 40.00 ms/step")
    assert t.fp8_speed_row("step 5", "fp8", {"status": "ok"}, (8, 0)).status.startswith("skip: SM < 8.9")
    assert t.fp8_speed_row("step 5", "fp8", {"status": "skipped", "reason": "no torchao"}, (9, 0)).status == \
        "skip: no torchao"
    assert t.fp8_speed_row("step 5", "fp8", {"status": "failed", "reason": "boom"}, (9, 0)).status == "fail"


def test_the_fp8_layers_row_passes_only_a_converted_timed_step_and_skips_a_device_without_fp8_units():
    import dataclasses

    from mfu_lab.core.engine.fp8 import Fp8Applied

    groups = ("mlp_up", "lm_head")
    done = dataclasses.asdict(Fp8Applied(groups, ("blocks.0.mlp.0", "blocks.1.mlp.0", "lm_head"), "tensorwise"))
    r = t.fp8_applied_row("step 5", "fp8_layers", done, 0.0487, (9, 0))
    assert (r.status, r.label) == ("pass", "measured")
    assert r.value == "48.7 ms/step with 3 Linear layer(s) in FP8 (mlp_up, lm_head, recipe tensorwise)"
    refused = dataclasses.asdict(Fp8Applied(groups, (), "tensorwise", "torchao is not installed (pip install x)"))
    assert t.fp8_applied_row("step 5", "f", refused, 0.05, (9, 0)).status == "fail"  # it should have converted
    assert t.fp8_applied_row("step 5", "f", dataclasses.asdict(Fp8Applied(groups)), 0.05, (9, 0)).status == "fail"
    a100 = dataclasses.asdict(Fp8Applied(groups, (), "tensorwise", "CUDA capability 8.0 has no FP8 tensor cores"))
    assert t.fp8_applied_row("step 5", "f", a100, 0.05, (8, 0)).status == (
        "skip: CUDA capability 8.0 has no FP8 tensor cores")
    assert t.fp8_applied_row("step 5", "f", done, None, (9, 0)).status == "fail"  # converted, but no step time


def test_add_records_a_reading_error_as_that_rows_failure():
    rows = []
    t.add(rows, "step 4", "w", lambda: t.figure_row("step 4", "w", 1.0))
    t.add(rows, "step 4", "v", lambda: object().missing_attribute)
    assert [r.status for r in rows] == ["pass", "fail"]
    assert "AttributeError" in rows[1].value and rows[1].figure == "v"


def test_table_written_as_markdown_and_json(tmp_path):
    rows = [t.Row("step 1", "CUDA-event step time", "12.3 ms", "measured", "pass"),
            t.Row("step 2", "SDPA cuDNN", "a | b", "-", "fail"),
            t.skip_row("step 2", "NCCL DDP world", "one GPU"),
            t.skip_row("step 7", "verify run", "time", "time: ~120 s needed, 20 s left")]
    header = {"date": "2025-01-01T00:00:00+00:00", "torch": "2.11.0", "CUDA": "12.8", "GPU": "1 x NVIDIA H200"}
    md, js = t.write_table(rows, header, tmp_path / "gpu-check")
    text = md.read_text()
    assert "| path | figure | value | label | pass/fail |" in text
    assert "| step 1 | CUDA-event step time | 12.3 ms | measured | pass |" in text
    assert "a \\| b" in text and "skip: one GPU" in text and "skip: time" in text
    assert "- GPU: 1 x NVIDIA H200" in text and "- torch: 2.11.0" in text
    assert "1 pass, 1 fail, 2 skipped" in text
    data = json.loads(js.read_text())
    assert data["header"] == header and [r["status"] for r in data["rows"]][:2] == ["pass", "fail"]
    lines = t.format_table(rows).splitlines()
    assert lines[0].split(" | ")[0].strip() == "path" and len(lines) == len(rows) + 2
    assert len({ln.index("|") for ln in lines if "|" in ln}) == 1  # columns aligned


# ---------------------------------------------------------------------- the job and the run loop
def test_small_job_is_a_valid_job():
    job = validate(load_job(gc.JOB_FILE).to_dict() | gc.SMALL_JOB | {"nproc_per_node": 2}, "gpu_check's small job")
    assert "reduce-overhead" in job.compile_modes and job.dtype == "bfloat16" and job.device == "cuda"
    assert job.verify_rounds == 2 and job.verify_steps == 5 and job.steps == 20 and job.warmup_steps == 5
    assert job.profile_warmup_steps >= 1  # the window opens after a synchronised warm-up
    assert job.fp8_steps >= job.fp8_window and job.d_model % 16 == 0  # torchao float8 takes multiples of 16


def test_main_without_cuda_returns_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.main([]) == 2
    assert "no CUDA device visible" in capsys.readouterr().out


def _fake_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 16)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


def test_main_records_failures_skips_for_time_and_prints_the_table_last(monkeypatch, tmp_path, capsys):
    _fake_gpus(monkeypatch)
    # As if the module had been imported an hour ago (a long suite before this test): main() called without
    # ``started`` counts --limit-s from its own start, so the steps that fit still run.
    monkeypatch.setattr(gc, "T0", gc.T0 - 3600.0)
    seen = {}

    def ok(ctx, rows):
        seen["world"] = ctx.world
        rows.append(t.figure_row("step 1", "CUDA-event step time", 12.3, "{:.1f} ms"))

    def boom(ctx, rows):
        rows.append(t.figure_row("step 2", "SDPA flash", 0.5, "{:.2f} ms"))
        raise RuntimeError("NCCL error: unhandled system error\ntraceback...")

    def never(ctx, rows):
        raise AssertionError("a step over the time limit must not run")

    monkeypatch.setattr(gc, "RUN", {"baseline": ok, "attention_comm": boom, "compile": never})
    monkeypatch.setattr(gc, "estimate_s", lambda step, world: 1e6 if step == "compile" else 0.0)
    rc = gc.main(["--steps", "baseline,attention_comm,compile", "--out", str(tmp_path)])
    assert rc == 1 and seen["world"] == 2  # 16 GPUs visible: capped at two ranks
    data = json.loads((tmp_path / "gpu-check" / "table.json").read_text())
    got = [(r["path"], r["figure"], r["status"]) for r in data["rows"]]
    assert got == [("step 1", "CUDA-event step time", "pass"), ("step 2", "SDPA flash", "pass"),
                   ("step 2", "attention_comm run", "fail"), ("step 4", "compile run", "skip: time")]
    assert data["rows"][2]["value"] == "RuntimeError: NCCL error: unhandled system error"
    assert "capped at 2" in data["header"]["ranks"] and "NVIDIA H200" in data["header"]["GPU"]
    out = capsys.readouterr().out.rstrip().splitlines()
    assert out[-1] == "2 pass, 1 fail, 1 skipped" and out[-7].startswith("path")
    assert (tmp_path / "gpu-check" / "table.md").read_text().count("\n| step") == 4


def test_main_counts_the_limit_from_the_start_it_is_given(monkeypatch, tmp_path, capsys):
    _fake_gpus(monkeypatch)

    def never(ctx, rows):
        raise AssertionError("a step over the time limit must not run")

    monkeypatch.setattr(gc, "RUN", {"baseline": never})
    monkeypatch.setattr(gc, "estimate_s", lambda step, world: 10.0)
    started = gc.time.monotonic() - 1000.0  # the script passes its import time: start-up counts against the limit
    rc = gc.main(["--steps", "baseline", "--limit-s", "560", "--out", str(tmp_path)], started=started)
    rows = json.loads((tmp_path / "gpu-check" / "table.json").read_text())["rows"]
    assert rc == 0 and [(r["figure"], r["status"]) for r in rows] == [("baseline run", "skip: time")]
    assert "0 s left of --limit-s 560" in rows[0]["value"]


def test_the_table_is_written_after_every_step(monkeypatch, tmp_path):
    """Issue 33 item 7: a call that overruns keeps the rows of the steps that finished: table.json holds step 1's
    row by the time step 2 starts."""
    _fake_gpus(monkeypatch)
    seen = {}

    def first(ctx, rows):
        rows.append(t.figure_row("step 1", "CUDA-event step time", 12.3, "{:.1f} ms"))

    def second(ctx, rows):
        seen["rows"] = json.loads((tmp_path / "gpu-check" / "table.json").read_text())["rows"]

    monkeypatch.setattr(gc, "RUN", {"baseline": first, "attention_comm": second})
    monkeypatch.setattr(gc, "estimate_s", lambda step, world: 0.0)
    gc.main(["--steps", "baseline,attention_comm", "--out", str(tmp_path)])
    assert [(r["path"], r["figure"]) for r in seen["rows"]] == [("step 1", "CUDA-event step time")]


def test_sdpa_on_the_same_kernel_as_its_twin_passes_naming_it():
    """Issue 33 item 6: on Hopper in bf16, torch's own SDPA choice is flash, so 'sdpa flash' is marked 'same
    kernel': a pass that names its twin, not a FAIL."""
    from types import SimpleNamespace

    a = SimpleNamespace(name="sdpa flash", status="same kernel", kernel="aten::_scaled_dot_product_flash_attention",
                        reason="dispatches to the same kernel as sdpa here (aten::_scaled_dot_product_flash_attention)"
                               ": its training step is the same")
    row = gc._attention_row(SimpleNamespace(attention=[a]), "sdpa flash", "SDPA flash")
    assert row.status == "pass" and "same kernel as sdpa " in row.value and "flash_attention" in row.value
    wrong = SimpleNamespace(name="sdpa flash", status="wrong", kernel="", reason="max error 0.3")
    assert gc._attention_row(SimpleNamespace(attention=[wrong]), "sdpa flash", "SDPA flash").status == "fail"


def test_parts_cover_every_step_once_riskiest_first():
    """Issue 33 item 7: the check runs as parts, each one 10-minute call: --part 1 holds the NCCL launches (step 2's
    race and confirmation, step 3's traces), and the parts together hold every step once, each within the call's
    limit by the estimates."""
    assert gc.parse_args(["--part", "1"]).steps == ["monitor", "baseline", "race1", "attention_comm", "kernels"]
    together = [s for k in sorted(t.PARTS) for s in t.PARTS[k]]
    assert sorted(together) == sorted(t.STEPS) and len(together) == len(set(together))
    for steps in t.PARTS.values():
        assert sum(t.estimate_s(s, 2) for s in steps) <= 560
    with pytest.raises(SystemExit):
        gc.parse_args(["--part", "9"])


def test_forced_world_of_one_runs_the_race_and_both_confirmations(tmp_path, tiny_job):
    """Issue 33 item 1: the check's forced world-of-1 launch of step 2's DDP worker (three configurations, so a race
    happens): here over gloo on the CPU, as it runs over NCCL on a one-GPU machine. The race's two rounds, the
    worker's confirmation (or the reference standing, which the row says) and the alternation launch each get a
    row of their own, and a path that did not run is never a pass."""
    import dataclasses

    import gpu_check_race as gr

    job = dataclasses.replace(tiny_job, comm_steps=2, comm_warmup_steps=1, race_steps=2, comm_timeout_s=120.0)
    ctx = t.Ctx(job, 1, 1, (0, 0), tmp_path)
    rows: list = []
    seen = gr.step_race_one_rank(ctx, rows, device_type="cpu")
    by = {r.figure: r for r in rows}
    assert set(by) == {"forced world-1 launch", "race round 1 (screening)", "race round 2 (finalists in full)",
                       "confirmation in the race's launch", "confirmation launch (alternation)"}
    assert by["forced world-1 launch"].status == "pass", by["forced world-1 launch"]
    assert "3/3 configurations done over gloo" in by["forced world-1 launch"].value
    assert by["race round 1 (screening)"].status == "pass"
    assert by["confirmation launch (alternation)"].status == "pass" and len(seen["alternation"].order) == 4
    confirm = by["confirmation in the race's launch"]
    assert confirm.status == "pass" or confirm.status.startswith("skip: the reference")
    assert seen["sweep"].layout["world_size"] == 1


def test_confirmation_and_round_rows_never_pass_a_failed_confirmation():
    """Issue 33 item 1: step 2's race rounds and step 2's and step 4's confirmations get rows of their own, and a
    failed confirmation is a fail, a skipped one a skip with its reason."""
    import gpu_check_race as gr

    from mfu_lab.analysis.racing import Confirmation, RaceLog, RoundLog

    ok = Confirmation("allreduce/25MB/copy", "none/25MB/copy", turns=2, steps=4, order=["a", "b", "b", "a"],
                      speedup=1.02, low=0.98, high=1.05)
    assert gr.confirmation_row("step 4", "c", ok).status == "pass"
    assert gr.confirmation_row("step 4", "c", Confirmation("x", "y", "failed", "rung died")).status == "fail"
    assert gr.confirmation_row("step 4", "c", Confirmation("x", "y", "skipped", "budget")).status == "skip: budget"
    short = Confirmation("x", "y", turns=2, order=["x", "y"], speedup=1.1, low=1.0, high=1.2)
    assert gr.confirmation_row("step 2", "c", short).status == "fail"  # half its turns: not a pass
    race = RaceLog("racing", ["none/25MB/copy"], [RoundLog(1, 2, {}, ["a", "b"], {"c": "slower"}, 3.0),
                                                  RoundLog(2, 4, {}, ["a", "b"], {}, 5.0)], confirmation=None)
    rows = gr.round_rows("step 2", race)
    assert [(r.figure, r.status.split(":")[0]) for r in rows] == [
        ("DDP race round 1", "pass"), ("DDP race round 2", "pass"), ("DDP confirmation", "skip")]
    assert "1 dropped" in rows[0].value
