"""Step 5's precision ladder: the adoption rule, the native-bf16 reader, the plan of rungs, and one run of the
step on the tiny job with one rung made to fail (no assertion on speed: only on what machine load cannot move)."""

import dataclasses
import json

import pytest

from mfu_lab.analysis import precision as pr
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.store.results import jsonable
from mfu_lab.steps.fp8 import ladder_timing as lt
from mfu_lab.steps.fp8 import precision_ladder as pl
from mfu_lab.steps.fp8 import rungs as rg
from mfu_lab.steps.fp8 import step as fp8

from .conftest import TINY

TOL = 0.02


def fig(name, speedup, low, high, gap=0.001, diverged=""):
    return pr.Figures(name, speedup, low, high, gap, diverged)


# ------------------------------------------------------------------ the adoption rule
def test_a_faster_rung_whose_loss_is_off_is_not_adopted():
    verdicts, adopted = pr.judge([fig("float16", 2.0, 1.8, 2.2, gap=0.05)], TOL)
    assert adopted is None and verdicts[0][0] == pr.OFF and "+5.00%" in verdicts[0][1]


def test_a_rung_whose_interval_contains_one_is_not_adopted():
    verdicts, adopted = pr.judge([fig("bfloat16", 1.3, 0.9, 1.6)], TOL)
    assert adopted is None and verdicts[0][0] == pr.NOT_FASTER and "contains 1.0" in verdicts[0][1]
    assert pr.judge([fig("bfloat16", 0.3, 0.25, 0.35)], TOL)[0][0][0] == pr.SLOWER


def test_the_fastest_proven_rung_with_its_loss_kept_wins():
    rungs = [pr.Figures("float32", status=pr.REFERENCE), fig("tf32", 1.4, 1.2, 1.6), fig("bfloat16", 1.9, 1.7, 2.1),
             fig("float16", 2.5, 0.8, 4.0), fig("fp16-off", 3.0, 2.8, 3.2, gap=0.1),
             fig("bad", 3.5, 3.0, 4.0, diverged="non-finite loss"), pr.Figures("x", status=pr.SKIPPED)]
    verdicts, adopted = pr.judge(rungs, TOL)
    assert adopted == "bfloat16"
    assert [s for s, _ in verdicts] == [pr.REFERENCE, pr.OK, pr.ADOPTED, pr.NOT_FASTER, pr.OFF, pr.DIVERGED,
                                        pr.SKIPPED]


def test_a_race_judges_a_rung_not_proven_faster_by_its_speed_alone_and_says_why():
    """Racing (issue 20): only a rung proven faster can be adopted, so the others train no loss curve; their
    verdict comes from the speed, with the reason."""
    why = "loss curve not trained: not proven faster than float32"
    slow = pr.Figures("float16", 0.9, 0.85, 0.95, None, "", "", why)
    maybe = pr.Figures("bfloat16", 1.1, 0.95, 1.2, None, "", "", why)
    verdicts, adopted = pr.judge([slow, maybe], TOL)
    assert adopted is None
    assert verdicts[0][0] == pr.SLOWER and why in verdicts[0][1]
    assert verdicts[1][0] == pr.NOT_FASTER and why in verdicts[1][1]
    faster = pr.Figures("bfloat16", 1.9, 1.8, 2.0, None, "", "", why)  # never skipped when faster: a failure
    assert pr.judge([faster], TOL)[0][0][0] == pr.FAILED


def test_a_rung_without_figures_is_never_adopted():
    verdicts, adopted = pr.judge([fig("bfloat16", None, None, None), pr.Figures("tf32", 1.5, 1.2, 1.8)], TOL)
    assert adopted is None and [s for s, _ in verdicts] == [pr.FAILED, pr.FAILED]


# ------------------------------------------------------------------ native bf16
CPUINFO = """processor\t: 0
model name\t: Some Xeon
flags\t\t: fpu sse sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16
processor\t: 1
flags\t\t: fpu sse sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16
"""


def test_native_bf16_flags_are_read_from_cpuinfo(tmp_path, monkeypatch):
    assert pr.native_bf16(CPUINFO) == {"flags": ["avx512_bf16", "amx_bf16"], "native": True, "source": "given text"}
    old = CPUINFO.replace(" avx512_bf16", "").replace(" amx_bf16", "")
    assert pr.native_bf16(old)["flags"] == [] and pr.native_bf16(old)["native"] is False
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert pr.native_bf16(arm)["native"] is True
    monkeypatch.setattr(pr, "CPUINFO", tmp_path / "absent")
    assert pr.native_bf16()["native"] is None  # cannot read it: claim nothing


# ------------------------------------------------------------------ the plan, skips and the choice
def test_tf32_is_skipped_on_a_cpu_with_its_reason():
    cpu = dev.resolve_device("cpu")
    rungs = pl.plan(load_job(TINY))
    assert [r.name for r in rungs] == ["float32", "tf32", "bfloat16", "float16"] and rungs[0].own
    why = pl.unavailable(rungs[1], cpu)
    assert "TF32" in why and "CPU" in why
    assert [pl.unavailable(r, cpu) for r in rungs if r.name != "tf32"] == ["", "", ""]


def test_the_jobs_own_precision_is_a_rung_and_float32_stays_the_reference():
    job = dataclasses.replace(load_job(TINY), dtype="bfloat16", precision_rungs=[])
    rungs = pl.plan(job)
    assert [(r.name, r.dtype, r.own) for r in rungs] == [("float32", "float32", False), ("bfloat16", "bfloat16", True)]
    job = dataclasses.replace(load_job(TINY), matmul_precision="high", precision_rungs=["float16"])
    assert [(r.name, r.own) for r in pl.plan(job)] == [("float32", False), ("float16", False), ("tf32", True)]


def rung(name, speedup=None, low=None, high=None, gap=None, status="", own=False):
    dtype, mp = rg.SETTINGS[name]
    return pl.Rung(name, dtype, mp, own=own, status=status, speedup=speedup, speedup_low=low, speedup_high=high,
                   final_gap=gap)


def test_slow_bf16_on_a_cpu_without_native_bf16_says_so_and_is_not_adopted():
    job = load_job(TINY)
    rungs = [rung("float32", 1.0, status=pr.REFERENCE, own=True), rung("bfloat16", 0.2, 0.15, 0.25, gap=0.0)]
    adopted = pl.settle(job, rungs, {"flags": [], "native": False, "source": "given text"})
    choice = pl.choose(job, rungs, adopted)
    assert adopted is None and rungs[1].status == pr.SLOWER and "no native bf16" in rungs[1].reason
    assert not choice["adopted"] and choice["dtype"] == "float32" and "no native bf16" in choice["text"]
    rungs = [rung("float32", 1.0, status=pr.REFERENCE, own=True), rung("bfloat16", 0.2, 0.15, 0.25, gap=0.0)]
    pl.settle(job, rungs, {"flags": ["amx_bf16"], "native": True, "source": "given text"})
    assert "native" not in rungs[1].reason


def test_the_choice_names_the_adopted_rung_with_its_figures():
    job = load_job(TINY)
    rungs = [rung("float32", 1.0, status=pr.REFERENCE, own=True), rung("bfloat16", 1.8, 1.6, 2.0, gap=0.004),
             rung("float16", 1.9, 1.7, 2.1, gap=0.06)]
    choice = pl.choose(job, rungs, pl.settle(job, rungs, None))
    assert {k: choice[k] for k in ("dtype", "matmul_precision", "rung", "adopted", "speedup", "final_gap")} == {
        "dtype": "bfloat16", "matmul_precision": "highest", "rung": "bfloat16", "adopted": True, "speedup": 1.8,
        "final_gap": 0.004}
    assert "1.80x [1.60, 2.00]" in choice["text"] and "dtype: bfloat16" in choice["text"]
    assert [r.status for r in rungs] == [pr.REFERENCE, pr.ADOPTED, pr.OFF]
    assert set(choice) >= {"dtype", "matmul_precision", "adopted", "rung", "text", "speedup", "speedup_low",
                           "speedup_high", "final_gap", "label"} and choice["label"] == "measured"


def test_a_jobs_own_precision_that_loses_the_loss_is_called_out():
    job = dataclasses.replace(load_job(TINY), dtype="float16")
    rungs = [rung("float32", 1.0, status=pr.REFERENCE), rung("float16", 2.0, 1.8, 2.2, gap=0.08, own=True)]
    choice = pl.choose(job, rungs, pl.settle(job, rungs, None))
    assert not choice["adopted"] and choice["dtype"] == "float16" and "consider float32" in choice["text"]


# ------------------------------------------------------------------ one run of the step, one rung made to fail
@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Step 5 on the tiny job with float16 failing to build and bfloat16 failing in its second timed round."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path_factory.mktemp("p")), fp8_steps=6,
                              precision_rounds=3, steps=4, thorough=True)  # loss curves first, as exhaustively
    real_build, real_steps = pl.build_model, lt.Runner.steps
    calls = {"bfloat16": 0}

    def build(j):
        if j.dtype == "float16":
            raise RuntimeError("no float16 kernels here (test)")
        return real_build(j)

    def steps(self, k):
        if self.rung.name == "bfloat16":
            calls["bfloat16"] += 1
            if calls["bfloat16"] == 3:  # warm-up, round 1, then round 2 fails
                raise RuntimeError("lost the device (test)")
        return real_steps(self, k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl, "build_model", build)  # the loss curves'
        mp.setattr(lt, "build_model", build)  # the timed rounds'
        mp.setattr(lt.Runner, "steps", steps)
        return job, fp8.run(job, progress=lambda m: None)


def test_failed_rungs_are_recorded_and_the_rest_of_the_step_is_kept(broken):
    job, r = broken
    by = {g["name"]: g for g in r.precision["rungs"]}
    assert by["float16"]["status"] == "failed" and "no float16 kernels here" in by["float16"]["reason"]
    assert by["bfloat16"]["status"] == "failed" and "lost the device" in by["bfloat16"]["reason"]
    assert len(by["bfloat16"]["loss"]) == job.fp8_steps  # its loss curve ran before the timing failed
    assert by["float32"]["status"] == "reference" and by["float32"]["step_median_s"] > 0
    assert by["tf32"]["status"] == "skipped" and "CPU" in by["tf32"]["reason"]
    assert r.precision["choice"]["adopted"] is False and r.precision["choice"]["dtype"] == "float32"
    assert r.metrics["precision_speedup"].value is None and r.metrics["precision_speedup"].source == "measured"
    assert r.trials and r.trials[0].status == "reference" and r.sensitivity  # the FP8 part ran in full
    assert {"precision float16", "precision tf32"} <= {s["what"] for s in r.skipped}
    assert r.advice[0].message == r.precision["choice"]["text"]


def test_the_interleave_order_alternates_the_rungs(broken):
    job, r = broken
    assert r.precision["order"] == [[i, n] for i in range(1, job.precision_rounds + 1) for n in ("float32", "bfloat16")]
    assert r.precision["native_bf16"]["source"]  # a CPU run records what it read


def test_the_precision_ladder_round_trips_and_draws(broken):
    job, r = broken
    d = json.loads((job.step_dir(fp8.INFO.folder) / "result.json").read_text())
    back = fp8.Fp8Result.from_dict(d)
    assert back.precision["choice"] == json.loads(json.dumps(jsonable(r.precision["choice"])))
    from mfu_lab import plots
    from mfu_lab.report.tables.fp8 import fp8_section, precision_table

    plots.precision(back)
    html = str(precision_table(back))
    assert "float16" in html and "failed" in html and "Precision ladder" in str(fp8_section(d))


def test_an_older_result_without_the_precision_ladder_still_loads(broken):
    job, r = broken
    d = json.loads((job.step_dir(fp8.INFO.folder) / "result.json").read_text())
    del d["precision"]
    old = fp8.Fp8Result.from_dict(d)
    assert old.precision == {} and old.choice == r.choice
    first = fp8.advise(old)[0]  # the FP8 advice leads when there is no ladder; emulated here: info, not adopted
    assert first.message.startswith(r.choice["text"]) and (first.severity == "info") == (old.path == "emulated")
    assert first.message.endswith("has no FP8 speed to give") == (old.path == "emulated")
    from mfu_lab.report.tables.fp8 import fp8_section, precision_table

    assert "Precision ladder" not in str(fp8_section(d)) and "No precision ladder" in str(precision_table(old))


# ------------------------------------------------------------------ the matmul probe rules rungs out before timing
def test_the_probe_rule_takes_the_probes_own_noise():
    ref = pr.probe_summary([100e9, 98e9, 103e9, 101e9, 99e9])
    assert pr.cannot_be_faster(pr.probe_summary([1.0e9, 1.1e9, 0.9e9, 1.0e9, 1.05e9]), ref)
    assert not pr.cannot_be_faster(pr.probe_summary([97e9, 99e9, 100e9, 96e9, 98e9]), ref)  # overlaps: may win
    assert not pr.cannot_be_faster(pr.probe_summary([200e9] * 5), ref)
    assert not pr.cannot_be_faster({}, ref) and not pr.cannot_be_faster(ref, {})  # no probe: nothing ruled out
    assert ref["label"] == "measured" and ref["p10"] < ref["flops_per_s"] < ref["p90"]
    with pytest.raises(ValueError):
        pr.probe_summary([])


def fake_probe(monkeypatch, rates):
    """Replace the matmul probe (never the machine's own bf16 speed): each rung's rate in GFLOP/s, +-1% in turn."""
    wobble = {}

    def probe(rung, device):
        wobble[rung.name] = wobble.get(rung.name, -1) + 1
        return rates[rung.name] * 1e9 * (1 + 0.01 * (wobble[rung.name] % 3 - 1))

    monkeypatch.setattr(rg, "probe", probe)


def spy_ladder(monkeypatch, tmp_path, rates, **changes):
    """Step 5's ladder (through fp8._precision) on the tiny job with the probe faked; which dtypes were built
    (training and timing both build a model), and which rungs were timed."""
    from types import SimpleNamespace

    from mfu_lab.core.engine.workload import build_loader

    fake_probe(monkeypatch, rates)
    built, timed = [], []
    real_build, real_init = pl.build_model, lt.Runner.__init__
    monkeypatch.setattr(pl, "build_model", lambda j: built.append(j.dtype) or real_build(j))  # loss curves
    monkeypatch.setattr(lt, "build_model", lambda j: built.append(j.dtype) or real_build(j))  # timed rounds

    def init(self, job, rung, *a, **k):
        timed.append(rung.name)
        real_init(self, job, rung, *a, **k)

    monkeypatch.setattr(lt.Runner, "__init__", init)
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), fp8_steps=4, precision_rounds=2,
                              precision_rungs=["bfloat16", "float16"], **changes)
    device = dev.resolve_device("cpu")
    skipped = []
    out = fp8._precision(job, list(build_loader(job, job.fp8_steps, "cpu")), device, lambda m: None, skipped)
    by = {g["name"]: g for g in out["rungs"]}
    return job, out, by, built, timed, skipped, SimpleNamespace(precision=out, job=job.to_dict())


def test_a_rung_whose_probe_cannot_reach_float32s_is_neither_trained_nor_timed(monkeypatch, tmp_path):
    job, out, by, built, timed, skipped, result = spy_ladder(
        monkeypatch, tmp_path, {"float32": 100.0, "bfloat16": 1.0, "float16": 150.0})
    bf = by["bfloat16"]
    assert bf["status"] == pr.CANNOT_BE_FASTER == "cannot be faster here"
    assert "bfloat16" not in built and "bfloat16" not in timed  # no model built: neither trained nor timed
    assert bf["step_median_s"] is None and bf["loss"] == [] and bf["speedup"] is None
    assert all(n != "bfloat16" for _, n in out["order"])
    p = bf["probe"]  # both rates, measured
    assert p["label"] == "measured" and p["cannot_be_faster"] is True
    assert p["flops_per_s"] == pytest.approx(1e9, rel=0.02)
    assert p["float32_flops_per_s"] == pytest.approx(1e11, rel=0.02)
    assert p["p10"] <= p["flops_per_s"] <= p["p90"] < p["float32_p10"] <= p["float32_p90"]
    assert by["float32"]["probe"]["flops_per_s"] == p["float32_flops_per_s"]
    assert "1 GFLOP/s" in bf["reason"] and "float32's 100 GFLOP/s" in bf["reason"] and "--thorough" in bf["reason"]
    assert any(s["what"] == "precision bfloat16" and s["reason"].startswith("cannot be faster here: its matmul")
               for s in skipped)
    # the faster rung is still timed beside float32, and the choice says why bf16 was not
    assert by["float16"]["status"] != pr.CANNOT_BE_FASTER and "float16" in timed
    assert [n for _, n in out["order"]] == ["float32", "float16"] * job.precision_rounds
    assert by["float16"]["step_median_s"] > 0 and by["float16"]["probe"]["flops_per_s"] > 1e11
    text = out["choice"]["text"]
    assert "bfloat16 cannot be faster here (its matmul probe reached 1 GFLOP/s" in text
    assert "ruled out before any training by 5 matmul probes" in text
    from mfu_lab import plots
    from mfu_lab.report.tables.fp8 import precision_table

    html = str(precision_table(result))
    assert "cannot be faster here" in html and "1 GFLOP/s" in html and "float32 100" in html
    plots.precision(result)


def test_thorough_still_times_a_rung_the_probe_rules_out(monkeypatch, tmp_path):
    job, out, by, built, timed, skipped, _ = spy_ladder(
        monkeypatch, tmp_path, {"float32": 100.0, "bfloat16": 1.0, "float16": 1.0}, thorough=True)
    for name in ("bfloat16", "float16"):
        g = by[name]
        assert name in timed and g["status"] != pr.CANNOT_BE_FASTER and g["step_median_s"] > 0
        assert len(g["loss"]) == job.fp8_steps  # trained too
        assert g["probe"]["cannot_be_faster"] and "timed anyway because --thorough" in g["reason"]
    assert [n for _, n in out["order"]] == ["float32", "bfloat16", "float16"] * job.precision_rounds


def test_every_rung_ruled_out_leaves_float32s_loss_curve_untimed(monkeypatch, tmp_path):
    job, out, by, built, timed, skipped, result = spy_ladder(
        monkeypatch, tmp_path, {"float32": 100.0, "bfloat16": 1.0, "float16": 2.0})
    assert timed == [] and out["order"] == [] and set(built) == {"float32"}
    assert {by[n]["status"] for n in ("bfloat16", "float16")} == {pr.CANNOT_BE_FASTER}
    assert len(by["float32"]["loss"]) == job.fp8_steps  # the FP8 part reuses it as its reference
    assert "not timed" in by["float32"]["reason"] and not out["choice"]["adopted"]


def test_a_rung_within_float32s_probe_noise_is_timed(monkeypatch, tmp_path):
    _, out, by, built, timed, _, _ = spy_ladder(
        monkeypatch, tmp_path, {"float32": 100.0, "bfloat16": 99.5, "float16": 100.5})
    assert timed == ["float32", "bfloat16", "float16"]
    assert not any(g["probe"].get("cannot_be_faster") for g in out["rungs"] if g["probe"])
