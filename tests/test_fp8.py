"""Step 5: FP8 emulation, per-layer sensitivity, the divergence watch and the step's result (the precision ladder
before FP8 has its own tests in test_precision.py)."""

import dataclasses
import json
import math

import pytest
import torch
import yaml
from torch import nn

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import load_job
from mfu_lab.steps.fp8 import policies
from mfu_lab.steps.fp8 import step as fp8

from .conftest import TINY


def test_quantise_keeps_representable_values_and_saturates_the_rest():
    exact = torch.tensor([1.0, -2.0, 0.5, 448.0])
    assert torch.equal(f8.quantise(exact, f8.E4M3, "none"), exact)
    assert float(f8.quantise(torch.tensor([1000.0]), f8.E4M3, "none")) == 448.0  # saturated, not inf or NaN
    tiny = torch.full((8,), 1e-6)
    assert float(f8.quantise(tiny, f8.E4M3, "none").abs().max()) == 0.0  # below e4m3's smallest subnormal
    assert torch.allclose(f8.quantise(tiny, f8.E4M3, "tensorwise"), tiny)  # a scale brings them back
    stats = f8.cast_stats(torch.cat([tiny, torch.tensor([1e4])]), f8.E4M3, "none")
    assert stats["underflow"] == pytest.approx(8 / 9) and stats["saturated"] == pytest.approx(1 / 9)


def test_emulated_linear_matches_fp32_closely_and_keeps_weight_tying():
    torch.manual_seed(0)
    lin = nn.Linear(16, 8)
    x = torch.randn(4, 16, requires_grad=True)
    ref = lin(x)
    f8.apply_policy(lin_holder := nn.Sequential(lin), ["0"], "tensorwise")
    assert type(lin_holder[0]) is f8.EmulatedFp8Linear and lin_holder[0].weight is lin.weight
    out = lin_holder(x)
    assert 20 < f8.snr_db(ref, out) < 60  # close, but not exact: FP8 rounding
    out.sum().backward()
    assert lin.weight.grad is not None and x.grad is not None


class TwoPaths(nn.Module):
    """Two linears on the same input; the second sees it with one huge outlier feature, which its weights
    ignore (as with the outlier features of large language models): the outlier sets the FP8 scale of the
    whole input and crushes every other value."""

    def __init__(self):
        super().__init__()
        self.plain, self.outlier = nn.Linear(32, 32), nn.Linear(32, 32)
        with torch.no_grad():
            self.outlier.weight[:, 0] = 0.0

    def forward(self, x):
        spiked = x.clone()
        spiked[..., 0] = 3e4
        return self.plain(x) + self.outlier(spiked)


def test_sensitivity_ranks_the_layer_fed_with_outliers_first():
    torch.manual_seed(0)
    model = TwoPaths()
    batches = [(torch.randn(64, 32) * 0.01, None) for _ in range(2)]
    sens = f8.sensitivity(model, lambda m, x, y: m(x).pow(2).mean(), batches)
    tw = {g.group: g for g in sens["tensorwise"]}
    assert min(tw.values(), key=lambda g: g.worst_snr_db).group == "outlier"
    assert tw["outlier"].input_underflow > 0.5 > tw["plain"].input_underflow  # the outlier's scale crushes the rest
    assert {g.group for g in sens["none"]} == {"plain", "outlier"}


def watch(ref=None):
    return f8.Watch(ref, tolerance=0.02, window=3, spike=10.0)


def test_the_watch_fires_on_nan_on_a_blow_up_and_on_a_spike():
    w = watch()
    assert w.check(4.0, 1.0) is None
    assert "non-finite loss" in w.check(math.nan, 1.0)
    ref = [4.0, 3.9, 3.8, 3.7, 3.6, 3.5]
    w = watch(ref)
    fired = [w.check(v, 1.0) for v in (4.0, 3.9, 3.8, 3.8, 4.4, 5.0)]  # steps 2-4: +8% over the reference
    assert fired[:4] == [None] * 4 and "loss above the reference" in fired[4]
    w = watch()
    for _ in range(6):
        assert w.check(3.0, 1.0) is None
    assert "gradient-norm spike" in w.check(3.0, 50.0)
    assert "non-finite gradient" in watch().check(3.0, math.inf)


def test_the_watch_stays_quiet_on_a_healthy_run():
    torch.manual_seed(0)
    ref = [4.0 - 0.02 * i for i in range(40)]
    w = watch(ref)
    for i, r in enumerate(ref):
        assert w.check(r * (1 + 0.005 * float(torch.randn(()))), 1.0 + 0.1 * float(torch.rand(()))) is None, i


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Step 5 with every policy and the scaling study (thorough): the exhaustive path."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path_factory.mktemp("f")), fp8_steps=12, thorough=True)
    return job, fp8.run(job, progress=lambda m: None)


def test_racing_stops_at_the_broadest_policy_that_keeps_the_loss_and_says_why(ran, tmp_path):
    """The choice is the broadest policy that keeps the loss; once one does, narrower ones cannot win and are not
    trained (issue 20). The thorough run above chose the same policy."""
    thorough_job, thorough = ran
    job = dataclasses.replace(thorough_job, out_dir=str(tmp_path), thorough=False)
    r = fp8.run(job, progress=lambda m: None, write=False)
    assert r.choice["policy"] == thorough.choice["policy"]
    ran_names = [t.name for t in r.trials if t.loss]
    assert ran_names == ["reference", r.choice["policy"]]  # the broadest first, and it kept the loss
    narrower = [t for t in r.trials if t.status == "skipped"]
    assert narrower and all("already kept the loss" in t.reason for t in narrower)
    assert all(t.flops_share < r.choice["flops_share"] for t in narrower)
    assert any("scaling study" in s["what"] for s in r.skipped)


def test_policies_the_budget_left_out_are_not_called_failures(ran, tmp_path):
    """A budget with no time left for a policy trial skips it; the recommendation then says that no policy was
    trained and which the budget left out, not that none kept the loss."""
    job = dataclasses.replace(ran[0], out_dir=str(tmp_path), thorough=False, budget_min=0.5)
    r = fp8.run(job, progress=lambda m: None, write=False)
    cut = [t for t in r.trials if t.status == "skipped" and t.reason.startswith("budget: ")]
    assert cut and not [t for t in r.trials if t.groups and t.loss]
    assert r.choice["policy"] is None
    text = r.choice["text"]
    assert "no FP8 policy was trained" in text and "the budget ran out first" in text
    assert all(t.name in text for t in cut if t.groups) and "kept the loss" not in text
    # decided up front: not even the reference trains, and the ladder trains float32's curve only for a rung
    assert [s["what"] for s in r.budget["shortened"]].count("FP8 policy trials") == 1
    assert all(t.status == "skipped" for t in r.trials)
    rungs = r.precision["rungs"]
    if all(g["status"] in fp8.NOT_RUN for g in rungs[1:]):  # no lower precision timed here (no native bf16)
        assert not rungs[0]["loss"] and "loss curve not trained" in rungs[0]["loss_skipped"]
    assert r.metrics["reference_final_loss"].value is None and "budget" in r.metrics["reference_final_loss"].note
    from mfu_lab import explore, plots
    fig = plots.fp8_losses(r)  # the notebook's plot says why there is no curve
    assert "No loss curves" in fig.axes[0].texts[0].get_text()
    fp8.advise(r)
    explore.draw_fp8(r, [])


def test_emulated_figures_are_labelled_and_no_speed_is_claimed(ran):
    _, r = ran
    assert r.path == "emulated" and r.speed["status"] == "skipped" and "CPU" in r.speed["reason"]
    m = r.metrics
    for name in ("worst_group_snr_db", "chosen_final_gap", "no_scaling_grad_underflow"):
        assert m[name].source == "emulated", name
    assert "fp8_speedup" not in m and "mfu" not in m
    assert any(a.message.startswith("FP8 numerics were emulated") for a in r.advice)


def test_policies_run_from_one_reference_and_the_choice_is_a_valid_job_fragment(ran):
    job, r = ran
    names = [t.name for t in r.trials]
    assert names[0] == "reference" and "mlp only" in names and "all linears, no scaling" in names
    ref = r.trials[0]
    assert len(ref.loss) == job.fp8_steps and ref.status == "reference"
    assert all(t.loss[0] == pytest.approx(ref.loss[0], rel=1e-2) for t in r.trials)  # same weights, same batch
    assert r.choice["groups"]  # the tiny model's loss stays with the reference under tensorwise FP8
    frag = yaml.safe_load(r.choice["fragment"])
    adopted = load_job(TINY, frag)
    assert adopted.fp8_layers == r.choice["groups"]
    chosen = next(t for t in r.trials if t.name == r.choice["policy"])
    assert chosen.status == "ok" and not chosen.study
    assert chosen.flops_share == max(t.flops_share for t in r.trials if t.status == "ok" and not t.study)
    d = json.loads((job.step_dir("05_fp8") / "result.json").read_text())
    assert fp8.Fp8Result.from_dict(d).choice == r.choice


def test_the_precision_ladder_comes_first_from_the_same_seed_and_batches(ran):
    job, r = ran
    p = r.precision
    names = [g["name"] for g in p["rungs"]]
    assert names == ["float32", "tf32", "bfloat16", "float16"]
    by = dict(zip(names, p["rungs"]))
    assert by["float32"]["status"] == "reference" and by["tf32"]["status"] == "skipped"  # a CPU has no TF32
    assert {g["status"] for g in p["rungs"]} <= {"reference", "adopted", "ok", "not faster", "slower", "off",
                                                 "diverged", "skipped", "failed"}
    ref = by["float32"]["loss"]
    assert len(ref) == job.fp8_steps and ref == pytest.approx(r.trials[0].loss, rel=1e-4)  # same run as FP8's
    for name in ("bfloat16", "float16"):
        assert by[name]["loss"][0] == pytest.approx(ref[0], rel=1e-2), name  # same weights, same first batch
        assert by[name]["speedup_low"] <= by[name]["speedup"] <= by[name]["speedup_high"]
    assert [n for _, n in p["order"]] == ["float32", "bfloat16", "float16"] * job.precision_rounds
    c = p["choice"]
    assert c["label"] == "measured" and c["text"] and r.advice[0].message == c["text"]
    assert c["adopted"] == any(g["status"] == "adopted" for g in p["rungs"])
    assert r.metrics["precision_speedup"].source == "measured"


def test_unknown_layer_groups_are_named_with_the_allowed_ones(tiny_job):
    job = dataclasses.replace(tiny_job, fp8_policies={"attn": ["attn_qkv", "attention_out"]})
    with pytest.raises(JobError) as err:
        fp8.run(job, progress=lambda m: None)
    text = str(err.value)
    assert "fp8_policies" in text and "attention_out" in text and "attn_out" in text


@pytest.mark.e2e
def test_notebook_runs_under_papermill_with_its_plots(full_run):
    from .test_e2e import assert_offline

    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    folder = job_root / "05_fp8"
    nb = json.loads((folder / "05_fp8.ipynb").read_text())
    outputs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # sensitivity heatmap, loss curves
    report = (folder / "report.html").read_text()
    assert "emulated" in report and "fp8_layers" in report
    assert_offline(report)
    assert "Step 5 · FP8" in (job_root / "index.html").read_text()


def test_recipes_follow_torchao():
    # tensorwise: e5m2 gradients; rowwise: e4m3 everywhere with power-of-two scales (torchao's recipe notes)
    assert f8.RECIPES["tensorwise"][2] is f8.E5M2 and f8.RECIPES["rowwise"][2] is f8.E4M3
    assert f8.RECIPES["rowwise_with_gw_hp"][1] is False  # grad_weight stays in high precision
    scale = f8._scale(torch.randn(4, 8) * 3, f8.E4M3, "rowwise", pow2=True)
    assert torch.equal(torch.log2(scale), torch.round(torch.log2(scale)))
    with pytest.raises(ValueError, match="recipe must be one of"):
        f8.apply_policy(nn.Sequential(nn.Linear(2, 2)), ["0"], "blockwise")


def test_a_torchao_failure_is_recorded_and_the_rest_kept(monkeypatch, tiny_job):
    import torch

    from mfu_lab.steps.fp8 import torchao_speed

    def broken(*args, **kwargs):
        raise RuntimeError("torchao: float8 needs in_features divisible by 16")

    monkeypatch.setattr(torchao_speed, "_real_speed", broken)
    skipped = []
    speed = torchao_speed.real_speed_or_failure(tiny_job, ["mlp"], torch.device("cpu"), print, skipped)
    assert speed == {"status": "failed", "reason": "RuntimeError: torchao: float8 needs in_features divisible by 16"}
    assert skipped == [{"what": "FP8 speed (torchao)", "reason": speed["reason"]}]


def test_the_fp8_reference_is_the_ladders_float32_curve_and_equals_a_fresh_run_of_it(ran):
    """No repeated work (issue 20): a float32 job's FP8 reference is the ladder's float32 curve, not a second
    training; an independent run of the reference's own training reproduces it step for step."""
    from mfu_lab.core.engine.workload import build_loader
    from mfu_lab.steps.fp8.precision_ladder import train_trial

    job, r = ran
    ref = r.trials[0]
    assert ref.status == "reference" and ref.reason == policies.LADDER_REUSED and len(ref.grad_norm) == job.fp8_steps
    quiet = dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0)
    batches = list(build_loader(quiet, max(job.fp8_sensitivity_batches, job.fp8_steps), "cpu"))[:job.fp8_steps]
    watch = f8.Watch(None, job.fp8_tolerance, job.fp8_window, job.fp8_spike)
    losses, norms, why, _ = train_trial(job, [], job.fp8_recipe, batches, torch.device("cpu"), watch)
    assert why is None and losses == pytest.approx(ref.loss, rel=1e-6) and norms == pytest.approx(ref.grad_norm,
                                                                                                 rel=1e-5)
    # another precision than the ladder's float32 rung: the reference is trained as the job trains
    assert policies._ladder_reference(dataclasses.replace(job, dtype="bfloat16"), r.precision) is None
    assert policies._ladder_reference(job, {"rungs": []}) is None
