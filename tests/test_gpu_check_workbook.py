"""benchmarks/gpu_check.py --workbook on a CPU: the plan (no budget when it fits; a budget that names the steps it
shortens; steps left out, in order, when even their minimums do not fit; a refusal), the side-by-side table from
step 7's result, the child's deadline and process group, and the exits without CUDA or without papermill. No
workbook is run here: the child is a few lines of Python, or replaced."""

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check as gc  # noqa: E402
import gpu_check_workbook as wb  # noqa: E402

from mfu_lab.core.job.schema import load_job  # noqa: E402
from mfu_lab.core.process import budget  # noqa: E402

DATA = ROOT / "tests" / "data"
OV = budget.STEP_OVERHEAD_S


def _est(**full) -> dict:
    """Estimates for the seven steps: 20 s in full and 10 s at least each, unless given (full, least)."""
    out = {k: wb.Estimate(20.0, 10.0, "test") for k in wb.KEYS}
    for k, (f, m) in full.items():
        out[k] = wb.Estimate(f, m, "test")
    return out


# ---------------------------------------------------------------------- the plan
def test_plan_without_a_budget_when_the_estimates_fit():
    p = wb.make_plan(560.0, 10.0, _est())
    assert p.budget_min is None and p.steps == list(wb.KEYS) and not p.shortened and not p.dropped
    assert p.cli_args() == ["--keep-going"]
    assert "fits: runs without a budget" in p.text()


def test_plan_budgets_and_names_the_steps_it_shortens():
    est = _est(compile=(400.0, 60.0), fp8=(250.0, 70.0))
    p = wb.make_plan(560.0, 12.0, est, overhead_s=OV)
    assert p.budget_min is not None and not p.dropped and not p.refused
    assert p.cli_args() == ["--keep-going", "--budget", f"{p.budget_min:g}"]
    assert [k for k, _ in p.shortened] == ["compile", "fp8"]  # only the steps over their share
    why = dict(p.shortened)
    assert "about 400 s in full" in why["compile"] and f"--budget {p.budget_min:g}" in why["compile"]
    # rolled: steps 2 and 3 leave most of their shares, which the run spreads again over the steps after them
    assert p.rolled["fp8"] > p.shares["fp8"] and f"about {p.rolled['fp8']:.0f} s as the run rolls it" in why["fp8"]
    assert "is over the share" not in why["fp8"]  # its least (70 s) fits the share it gets once rolled
    text = p.text()
    assert "shortened: step 4 (compile)" in text and "shortened: step 5 (fp8)" in text
    assert "shortened: step 1" not in text and "does not fit: runs with --budget" in text
    # the budget plans no more than the margin of the time left, and the steps' least fits in that time
    planned = sum(budget.plan(p.budget_min, p.steps, OV).values()) + len(p.steps) * OV
    assert planned <= wb.MARGIN * p.available_s + 1e-6
    assert sum(max(p.shares[k], est[k].min_s) + wb.H200.notebook_s for k in p.steps) <= p.available_s
    # the check's own time counts: the same limit later leaves a smaller budget
    assert wb.make_plan(560.0, 100.0, est, overhead_s=OV).budget_min < p.budget_min


def test_the_plan_rolls_the_budget_as_the_runner_does():
    """Each step's rolled share, counted here by hand: the budget's planned seconds less what the steps before it
    took (their estimate within [least, share], and a notebook), spread by the weights over the steps left."""
    est = _est(compile=(400.0, 60.0), fp8=(250.0, 70.0))
    p = wb.make_plan(560.0, 12.0, est, overhead_s=OV)
    w, keys = budget.WEIGHTS, list(wb.KEYS)
    left = sum(budget.plan(p.budget_min, keys, OV).values()) + len(keys) * OV
    for i, k in enumerate(keys):
        share = p.shares[k] if k == "baseline" else (left - OV * len(keys[i:])) * w[k] / sum(w[x] for x in keys[i:])
        assert p.rolled[k] == pytest.approx(share)
        left -= max(est[k].min_s, min(est[k].full_s, share)) + wb.H200.notebook_s
    assert "as the run rolls them" in p.text()
    # the same seconds under the runner's own reader of the rolled share (budget.share_s, from LEFT_ENV)
    import os
    used = 0.0
    for k in keys:
        if k != "baseline":  # step 1's share is its own (budget.step1_share_s)
            os.environ[budget.LEFT_ENV] = budget.left_env(p.budget_min, keys, used, k, OV)
            try:
                assert budget.share_s(p.budget_min, k) == pytest.approx(p.rolled[k], abs=0.01)  # env: 3 decimals
            finally:
                del os.environ[budget.LEFT_ENV]
        used += max(est[k].min_s, min(est[k].full_s, p.rolled[k])) + wb.H200.notebook_s


def test_plan_for_the_gpu_job_in_one_call():
    """gpt2_124m_gpu.yaml's estimates on one H200 do not fit a 10-minute call without a budget: the plan budgets,
    names step 4 (three compile modes) among the shortened, runs every step, and keeps steps 1 and 7."""
    job = load_job(gc.JOB_FILE)
    est = wb.estimates(job)
    assert set(est) == set(wb.KEYS) and all(e.min_s <= e.full_s for e in est.values())
    p = wb.make_plan(560.0, 12.0, est)
    assert p.full_s > p.available_s and p.budget_min is not None and p.steps == list(wb.KEYS)
    assert "compile" in dict(p.shortened)
    # step 7 gets what steps 2 and 6 leave (25 and 30 s of their ~76 and ~70 s): enough for its full run
    assert "verify" not in dict(p.shortened) and p.rolled["verify"] >= est["verify"].full_s > p.shares["verify"]
    assert wb.make_plan(3600.0, 12.0, est).budget_min is None  # an hour: every step in full


def test_the_proof_leaves_out_the_steps_step_7_cannot_time_when_the_budget_would_cut_the_races():
    """gpt2_124m_gpu.yaml on one GPU in one call: the CPU-weighted budget would cut step 3's AdamW and batch races and
    step 4's loss race, which carry the changes step 7 times; steps 6 (a cluster's placement) and 5 (a bf16 job, no
    FP8 rung timed) adopt nothing step 7 times here, so they are left out, said why, and the races fit."""
    import dataclasses

    job = load_job(gc.JOB_FILE)
    est = wb.estimates(job)
    untimed = wb.untimed_steps(job, 1)
    assert set(untimed) == {"placement", "fp8"}
    assert est["kernels"].levers_s == est["kernels"].full_s and "AdamW and batch (3 splits) races" in est["kernels"].how
    assert "the loss race" in est["compile"].how and est["compile"].min_s < est["compile"].levers_s
    whole = wb.make_plan(560.0, 12.0, est, overhead_s=OV)  # without the rule: every step, the races cut
    assert whole.steps == list(wb.KEYS) and whole.rolled["kernels"] < est["kernels"].levers_s
    p = wb.make_plan(560.0, 12.0, est, overhead_s=OV, untimed=untimed)
    assert [k for k, _ in p.dropped] == ["placement", "fp8"] and p.steps == [
        "baseline", "attention_comm", "kernels", "compile", "verify"]
    for k in wb.LEVER_STEPS:
        assert p.rolled[k] >= est[k].levers_s
    assert p.rolled["verify"] >= est["verify"].full_s
    why = dict(p.dropped)
    assert why["placement"].startswith("on one GPU step 6 models a cluster's placement")
    assert "already trains in bfloat16" in why["fp8"] and "which the budget would cut (step 3's" in why["fp8"]
    args = p.cli_args()
    assert args[args.index("--steps") + 1] == "baseline,attention_comm,kernels,compile,verify"
    # the same limit on two GPUs, or a float32 job (step 5's ladder is its lever): those steps stay candidates
    assert "placement" not in wb.untimed_steps(job, 2)
    assert "fp8" not in wb.untimed_steps(dataclasses.replace(job, dtype="float32"), 1)
    # an hour: nothing cut, nothing left out
    assert not wb.make_plan(3600.0, 12.0, est, overhead_s=OV, untimed=untimed).dropped


def test_the_estimates_count_an_optimizer_step_as_grad_accum_micro_batches():
    """The H200 costs timed one micro-batch of 16 (a72853b's job had no accumulation); gpt2_124m_gpu.yaml's step is
    4 of them, so its timed steps cost 4x: step 1's 24 steps of 196 ms, not of 49 ms."""
    import dataclasses

    job = load_job(gc.JOB_FILE)
    assert job.grad_accum == 4 and job.micro_batch == wb.COSTS_MICRO_BATCH
    timed = job.warmup_steps + job.steps
    four, one = wb.estimates(job), wb.estimates(dataclasses.replace(job, grad_accum=1))
    assert four["baseline"].full_s - one["baseline"].full_s == pytest.approx(3 * timed * wb.H200.step_s)
    assert "steps of 196 ms" in four["baseline"].how and "steps of 49 ms" in one["baseline"].how
    half = wb.estimates(dataclasses.replace(job, grad_accum=1, micro_batch=8))  # half the samples of one
    assert one["baseline"].full_s - half["baseline"].full_s == pytest.approx(timed * wb.H200.step_s / 2)


def test_plan_leaves_steps_out_in_order_when_their_minimums_do_not_fit():
    est = _est(compile=(400.0, 60.0), fp8=(250.0, 70.0), placement=(40.0, 30.0), verify=(50.0, 40.0))
    p = wb.make_plan(250.0, 12.0, est, overhead_s=OV)
    dropped = [k for k, _ in p.dropped]
    assert dropped and dropped == list(wb.DROP_ORDER[:len(dropped)])
    assert "baseline" in p.steps and "verify" in p.steps and not set(dropped) & set(p.steps)
    args = p.cli_args()
    assert args[args.index("--steps") + 1] == ",".join(p.steps) and "--budget" in args
    assert "left out: step 6 (placement)" in p.text()
    assert sum(max(p.shares[k], est[k].min_s) + wb.H200.notebook_s for k in p.steps) <= p.available_s


def test_plan_refuses_a_limit_too_small_for_steps_1_and_7():
    p = wb.make_plan(60.0, 12.0, _est(verify=(50.0, 40.0)), overhead_s=OV)
    assert p.refused.startswith("steps 1 and 7 alone need") and "larger --limit-s" in p.refused
    assert p.steps == ["baseline", "verify"] and "REFUSED" in p.text()


@pytest.mark.parametrize("keys", [list(wb.KEYS), ["baseline", "verify"], ["baseline", "compile", "verify"]])
@pytest.mark.parametrize("seconds", [200.0, 466.0, 900.0])
def test_budget_min_for_inverts_the_runners_plan(keys, seconds):
    b = wb.budget_min_for(seconds, keys, OV)
    got = sum(budget.plan(b, keys, OV).values()) + len(keys) * OV
    more = sum(budget.plan(b + 0.1, keys, OV).values()) + len(keys) * OV
    assert got <= seconds < more  # the largest tenth of a minute that plans no more than the seconds


# ---------------------------------------------------------------------- step 7's table
def _verify_fixture(tmp_path: Path, withdraw: bool = False) -> dict:
    """A step-7 result in the current schema: the stored default run's, with a staircase of two measured rungs
    (original, compile) whose speedups step 7's own code computes. The figures are made up in the shape of an
    H200 run (48.7 ms against 42.0 ms a step), not a measurement."""
    from mfu_lab.core.store.results import jsonable
    from mfu_lab.steps.verify import staircase
    from mfu_lab.steps.verify.rungs import Rung
    from mfu_lab.steps.verify.step import VerifyResult

    d = json.loads((DATA / "default_run_results.json").read_text())["results"]["verify"]
    r = VerifyResult.from_dict(d)
    peak = dict(peak_flops_per_s=989.4e12, peak_source="datasheet", peak_precision="bf16", dtype="bfloat16")
    walls = [[0.0487 + 0.0001 * (i % 3) for i in range(40)], [0.0420 + 0.0001 * (i % 3) for i in range(40)]]
    r.rungs = [Rung("original", {}, "ok", step_median_s=0.0488, step_p10_s=0.0487, step_p90_s=0.0489,
                    tokens_per_s=335_700.0, mfu=0.289, wall_s=walls[0], loss=[4.0] * 40, **peak),
               Rung("compile", {"compile_mode": "default"}, "ok", step_median_s=0.0421, step_p10_s=0.0420,
                    step_p90_s=0.0422, tokens_per_s=389_100.0, mfu=0.335, wall_s=walls[1], loss=[4.0] * 40, **peak)]
    staircase.speedups(r.rungs)
    r.loss = staircase.compare_losses(load_job(gc.JOB_FILE), r.rungs[0], r.rungs[1])
    r.headline = staircase.headline(r.rungs[0], r.rungs[1], r.rungs, r.loss)
    r.metrics = staircase.metrics(r.rungs[0], r.rungs[1], r.loss)
    r.skipped = []
    r.changes = [{"rung": "compile", "step": "compile", "key": "compile_mode", "old": "off", "new": "default",
                  "evidence": "step 4", "label": "proposed", "lossy": False, "adopted": True, "reason": ""}]
    if withdraw:
        r.changes.append({"rung": "compile", "step": "verify", "key": "compile_mode", "old": "default", "new": "off",
                          "evidence": "step 7", "label": "measured", "lossy": False, "adopted": True,
                          "reason": "withdrawn: not verified faster"})
    out = jsonable(r)
    VerifyResult.from_dict(out)  # the fixture is a result step 7 could have written
    return out


def _job_folder(tmp_path: Path, verify: dict | None) -> Path:
    root = tmp_path / "out" / "gpt2-124m-1gpu"
    (root / "01_baseline").mkdir(parents=True)
    (root / "01_baseline" / "result.json").write_text((DATA / "h200" / "01_baseline_result.json").read_text())
    if verify is not None:
        (root / "07_verify").mkdir()
        (root / "07_verify" / "result.json").write_text(json.dumps(verify))
    return root


def test_side_by_side_from_a_step7_result(tmp_path):
    v = _verify_fixture(tmp_path)
    root = _job_folder(tmp_path, v)
    results, notes = wb.read_results(root, time.time() - 5)
    assert set(results) == {"baseline", "verify"} and notes["compile"] == "no result (not run)"
    t = wb.side_by_side(results["baseline"], results["verify"])
    speedup = 0.0488 / 0.0421  # the ratio of the rungs' medians, as step 7 computes it
    pair = {r["figure"]: (r["original"], r["tuned"]) for r in t["pair"]}
    assert pair["rung"] == ("original", "compile")
    assert pair["median step (p10-p90)"] == ("48.8 ms (48.7-48.9)", "42.1 ms (42.0-42.2)")
    assert pair["MFU"] == ("28.9%", "33.5%") and pair["tokens/s"] == ("335,700", "389,100")
    assert pair["peak"][1] == "989.4 TFLOP/s bf16 (datasheet)"
    assert pair["speedup over the original"][1].startswith(f"{v['rungs'][1]['speedup']:.2f}x [")
    assert abs(v["rungs"][1]["speedup"] - speedup) < 0.02
    assert [r["rung"] for r in t["rungs"]] == ["original", "compile"] and t["rungs"][1]["changes"] == \
        "compile_mode=default"
    assert t["tuned_mfu"] == 0.335 and t["original_mfu"] == 0.289 and t["tuned_rung"] == "compile"
    one, tuned = wb.mfu_lines(t)
    assert one.startswith("step 1's MFU: 29.0% [measured], 48.7 ms a step") and "989.4 TFLOP/s (datasheet)" in one
    assert tuned.startswith("tuned MFU (step 7, side by side, rung compile): 33.5%") and "original in the same " \
        "rounds 28.9%" in tuned
    # written as markdown and JSON beside the check's table
    steps = wb.step_rows(None, None, results, notes)
    md, js = wb.write_report(tmp_path / "out" / "gpu-check", {"GPU": "1 x NVIDIA H200"}, t, steps, [], None, None)
    assert md.name == "workbook.md" and js.name == "workbook.json"
    text = md.read_text()
    assert "| MFU | 28.9% | 33.5% |" in text and "- step 1's MFU: 29.0%" in text and "| 7 verify |" in text
    assert json.loads(js.read_text())["table"]["tuned_mfu"] == 0.335
    printed = wb.format_report(t, steps, [], None, None)
    assert printed.rstrip().splitlines()[-1].startswith("tuned MFU") and "original against the tuned" in printed


def test_a_rung_step7_withdrew_is_never_the_tuned_job(tmp_path):
    t = wb.side_by_side(None, _verify_fixture(tmp_path, withdraw=True))
    assert t["withdrawn"] == ["compile"] and t["tuned_mfu"] is None and t["speedup"] is None
    assert t["rungs"][1]["status"] == "ok, withdrawn by step 7"
    pair = {r["figure"]: r["tuned"] for r in t["pair"]}
    assert pair["rung"].startswith("original (step 7 withdrew compile") and pair["MFU"] == "28.9%"
    assert "step 1's MFU: - (no step-1 result" in wb.mfu_lines(t)[0]
    assert wb.mfu_lines(t)[1].startswith("tuned MFU: the original's, 28.9%")


def test_step7s_second_turn_is_the_proof_when_it_ran(tmp_path):
    """A rung withdrawn below the top: step 7 timed the tuned file as written beside the original again, and the
    table's pair is that turn's, not the top rung's (which held the withdrawn change)."""
    v = _verify_fixture(tmp_path, withdraw=True)
    again = dict(v["rungs"][0], name="original again")
    written = dict(v["rungs"][1], name="tuned as written", mfu=0.341, step_median_s=0.0413)
    v["rungs"] += [again, written]
    t = wb.side_by_side(None, v)
    pair = {r["figure"]: (r["original"], r["tuned"]) for r in t["pair"]}
    assert t["tuned_rung"] == "tuned as written" and t["tuned_mfu"] == 0.341 and pair["MFU"][1] == "34.1%"
    v["rungs"][-1] = dict(written, wall_s=[])  # the second turn failed: back to the staircase's reading
    assert wb.side_by_side(None, v)["tuned_rung"] is None


def test_no_staircase_says_why():
    """The H200 run under --budget 4 adopted nothing: no rung was timed, and the table says step 7's reason."""
    v = json.loads((DATA / "default_run_results.json").read_text())["results"]["verify"]
    t = wb.side_by_side(None, v)
    assert t["pair"] == [] and t["tuned_mfu"] is None and any("the staircase" in s for s in t["skipped"])
    assert wb.mfu_lines(t)[1].startswith("tuned MFU: - (no tuned job was timed against the original: No adopted")
    assert wb.side_by_side(None, None)["headline"] == "step 7 left no result from this run"


def test_results_of_an_earlier_run_and_failures_are_not_this_runs(tmp_path):
    root = _job_folder(tmp_path, {"rungs": []})
    old = time.time() - 3600
    os.utime(root / "07_verify" / "result.json", (old, old))
    (root / "04_compile").mkdir()
    (root / "04_compile" / "result.json").write_text("{}")
    (root / "04_compile" / "failure.json").write_text(json.dumps({"status": "failed", "error": "OOM | boom"}))
    results, notes = wb.read_results(root, time.time() - 60)
    assert set(results) == {"baseline"}
    assert notes["verify"].startswith("stale") and notes["compile"] == "failed: OOM | boom"


def test_step_rows_and_budget_records():
    plan = wb.make_plan(560.0, 12.0, _est(compile=(400.0, 60.0)), overhead_s=OV)
    out = wb.Outcome(rc=1, walls={"01_baseline": 20.0}, failed={"04_compile": "RuntimeError: x"})
    results = {"baseline": {"elapsed_s": 9.6}, "kernels": {"budget": {"shortened": [
        {"what": "per-rank profile", "reason": "budget: does not fit"}]}}}
    rows = {r["step"]: r for r in wb.step_rows(plan, out, results, {})}
    assert rows["1 baseline"]["actual"] == "20 s" and rows["1 baseline"]["step's own"] == "10 s"
    assert rows["4 compile"]["result"] == "FAILED: RuntimeError: x"
    assert wb.shortened_by_steps(results) == ["step 3 (kernels): per-rank profile: budget: does not fit"]


# ---------------------------------------------------------------------- the child
def test_watch_line_reads_the_runners_lines():
    out = wb.Outcome()
    for line in ["[1/7] 01_baseline: Baseline: where does the step time go today?",
                 "[1/7] 01_baseline done in 20 s -> outputs/x/01_baseline/report.html",
                 "[2/7] 02_attention_and_comm: Attention kernels",
                 "[2/7] 02_attention_and_comm FAILED: NameError: name 'x' is not defined"]:
        wb.watch_line(line, out)
    assert out.walls == {"01_baseline": 20.0} and out.running == "02_attention_and_comm"
    assert out.failed == {"02_attention_and_comm": "NameError: name 'x' is not defined"}


CHILD = """
import os, signal, subprocess, sys, time
marker = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *a: open(marker, "w").write("term"))  # a child that will not end by itself
grand = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # in the child's process group
open(marker + ".pid", "w").write(str(grand.pid))
print("[1/2] 01_baseline: Baseline", flush=True)
print("[1/2] 01_baseline done in 3 s -> x", flush=True)
print("[2/2] 07_verify: Verify", flush=True)
while True:
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_child_is_stopped_at_the_deadline_with_its_group(tmp_path):
    """A run past the deadline gets SIGTERM (mfu-lab run takes it as Ctrl-C and ends its kernel), then SIGKILL
    after the grace; whatever it started in its group ends with it, and the lines it printed were read."""
    marker = tmp_path / "term"
    seen = []
    t0 = time.monotonic()
    out = wb.run_child([sys.executable, "-c", CHILD, str(marker)], dict(os.environ), tmp_path, t0 + 3.0,
                       seen.append, grace_s=1.0)
    took = time.monotonic() - t0
    assert 3.0 <= took < 8.0
    assert marker.read_text() == "term"  # SIGTERM first
    assert out.rc == -signal.SIGKILL  # then SIGKILL, as it would not end
    assert "deadline" in out.stopped and "07_verify" in out.stopped and not out.interrupted
    assert out.walls == {"01_baseline": 3.0} and "[2/2] 07_verify: Verify" in seen
    grand = int((tmp_path / "term.pid").read_text())
    for _ in range(50):
        if not _alive(grand):
            break
        time.sleep(0.1)
    assert not _alive(grand)


def test_a_child_that_ends_by_itself_is_read_to_its_end(tmp_path):
    code = "print('[7/7] 07_verify FAILED: RuntimeError: boom'); raise SystemExit(1)"
    out = wb.run_child([sys.executable, "-c", code], dict(os.environ), tmp_path, time.monotonic() + 60, lambda s: None)
    assert out.rc == 1 and out.failed == {"07_verify": "RuntimeError: boom"} and not out.stopped


def test_child_env_finds_the_checkout_and_plots_headless(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/tmp/site")
    monkeypatch.delenv("MPLBACKEND", raising=False)
    env = wb.child_env(ROOT)
    assert env["PYTHONPATH"].split(os.pathsep) == ["/tmp/site", str(ROOT)] and env["MPLBACKEND"] == "Agg"
    assert env["PYTHONUNBUFFERED"] == "1"


# ---------------------------------------------------------------------- the mode's exits and its run
def test_workbook_arguments():
    args = gc.parse_args(["--workbook", "--out", "x"])
    assert args.workbook and args.job == gc.JOB_FILE.resolve() and args.limit_s == 560.0
    for bad in (["--workbook", "--quick"], ["--workbook", "--skip-verify"], ["--allow-cpu"],
                ["--job", "tests/data/tiny.yaml"]):
        with pytest.raises(SystemExit):
            gc.parse_args(bad)


def test_workbook_without_cuda_returns_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(wb, "run_child", lambda *a, **k: pytest.fail("nothing may start without CUDA"))
    assert gc.main(["--workbook"]) == 2
    assert "no CUDA device visible" in capsys.readouterr().out


def test_the_steps_are_the_registrys_and_the_check_imports_no_torch():
    """The mode names the steps as the registry does, and says a missing Jupyter stack before torch's import: the
    check's modules import neither torch nor mfu_lab (whose facade imports torch)."""
    import subprocess

    from mfu_lab.core.registry import STEPS

    assert wb.FOLDER == {s.key: s.folder for s in STEPS} and wb.NUMBER == {s.key: s.number for s in STEPS}
    code = "import sys; import gpu_check; print(sorted({'torch', 'mfu_lab'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "benchmarks", capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT / "benchmarks")})
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_missing_papermill_prints_the_install_line(monkeypatch, capsys):
    assert wb.missing_modules() == []  # this venv has the Jupyter stack
    assert wb.missing_modules(("papermill", "no_such_module_xyz")) == ["no_such_module_xyz"]
    monkeypatch.setattr(wb, "missing_modules", lambda: ["papermill", "nbconvert"])
    monkeypatch.setattr(wb, "run_child", lambda *a, **k: pytest.fail("nothing may start without papermill"))
    assert gc.main(["--workbook"]) == 2
    out = capsys.readouterr().out
    assert "papermill, nbconvert not installed" in out
    assert "pip install -q --no-index --no-deps" in out and ".whl/*.whl" in out and "PYTHONPATH=/tmp/site" in out


def _fake_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")


def test_workbook_refuses_a_limit_too_small(monkeypatch, capsys):
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(wb, "run_child", lambda *a, **k: pytest.fail("a refused plan starts nothing"))
    assert gc.main(["--workbook", "--limit-s", "40"]) == 2
    assert "REFUSED: steps 1 and 7 alone need" in capsys.readouterr().out


def test_workbook_runs_the_plan_and_ends_with_the_table(monkeypatch, tmp_path, capsys):
    """The mode plans, prints the plan, starts `python -m mfu_lab run JOB --out OUT` with the plan's options, and
    ends with the table built from this run's step-1 and step-7 results (the child replaced: it writes them)."""
    _fake_gpu(monkeypatch)
    v = _verify_fixture(tmp_path)
    seen = {}

    def child(cmd, env, cwd, deadline, say, grace_s=wb.GRACE_S):
        seen["cmd"], seen["deadline"] = cmd, deadline
        _job_folder(tmp_path, v)  # written now: this run's
        say("[7/7] 07_verify done in 9 s -> x")
        return wb.Outcome(rc=0, seconds=1.0, walls={"07_verify": 9.0})

    monkeypatch.setattr(wb, "run_child", child)
    t0 = time.monotonic()
    rc = gc.main(["--workbook", "--out", str(tmp_path / "out")], started=t0)
    out = capsys.readouterr().out
    assert rc == 0
    cmd = seen["cmd"]
    assert cmd[:5] == [sys.executable, "-m", "mfu_lab", "run", str(gc.JOB_FILE)]
    assert cmd[5:8] == ["--out", str(tmp_path / "out"), "--keep-going"] and "--budget" in cmd  # 560 s: budgeted
    assert seen["deadline"] == pytest.approx(t0 + 560.0 - wb.GRACE_S - wb.TABLE_S)
    assert out.index("workbook plan:") < out.index("running: ") < out.index("tuned MFU")
    assert "shortened: step 4 (compile)" in out
    # one GPU, a bf16 job: steps 6 and 5 left out so that steps 3 and 4's races fit (the plan says why)
    assert cmd[cmd.index("--steps") + 1] == "baseline,attention_comm,kernels,compile,verify"
    assert "left out: step 6 (placement): on one GPU" in out and "left out: step 5 (fp8)" in out
    assert out.rstrip().splitlines()[-1].startswith("tuned MFU (step 7, side by side, rung compile): 33.5%")
    data = json.loads((tmp_path / "out" / "gpu-check" / "workbook.json").read_text())
    assert data["plan"]["budget_min"] is not None and data["header"]["GPU"] == "1 x NVIDIA H200"
    assert data["table"]["step1"]["mfu"] == pytest.approx(0.2902, abs=1e-4)
    assert dataclasses.asdict(wb.Outcome())  # the outcome is plain data (written to the JSON)
