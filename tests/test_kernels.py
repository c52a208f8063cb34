"""Step 3: profiling real steps on CPU, fusion-candidate detection, and the step's result and report."""

import dataclasses
import gzip
import json

import pytest
import torch
from torch import nn

from mfu_lab.analysis.trace import breakdown as tr
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure.timed import profile_steps
from mfu_lab.steps.baseline import step as baseline
from mfu_lab.steps.kernels import step as kernels

from .conftest import TINY
from .test_e2e import assert_offline

B, D = 8, 16


class WithChain(nn.Module):
    """A residual add, LayerNorm and dropout back to back between two matmuls."""

    def __init__(self):
        super().__init__()
        self.inp, self.ln, self.drop, self.out = nn.Linear(D, D), nn.LayerNorm(D), nn.Dropout(0.1), nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.drop(self.ln(x + self.inp(x))))


def profile_model(model, tmp_path):
    def step(x, y):
        loss = model(x).sum()
        loss.backward()
        return loss.detach()

    batches = [(torch.randn(B, D), torch.zeros(B)) for _ in range(3)]
    timings = profile_steps(step, batches, torch.device("cpu"), 1, 2, tmp_path / "t.json.gz")
    trace = tr.load_trace(tmp_path / "t.json.gz")
    assert len(timings.measured("wall_s")) == 2
    return tr.analyse(trace, bandwidth=1e10)


def test_finds_the_add_norm_dropout_chain_in_a_model_built_with_it(tmp_path):
    a = profile_model(WithChain().train(), tmp_path)
    assert a.steps == 2
    by = {c.pattern: c for c in a.fusion}
    c = by["add + layer_norm + dropout"]
    assert c.per_step == 1 and c.categories == ["elementwise", "normalisation", "elementwise"]
    assert c.saved_bytes_per_step == 2 * 2 * B * D * 4  # the add's and the norm's outputs, written and read back
    assert "norm" in c.remedy and c.example_shapes.startswith(f"{B}x{D} float")


def test_finds_no_candidate_in_a_model_without_one(tmp_path):
    model = nn.Sequential(nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False))
    a = profile_model(model, tmp_path)
    assert a.fusion == []
    assert a.category_share["matmul"] > 0


def test_profile_steps_writes_a_gzipped_trace(tmp_path):
    profile_model(WithChain(), tmp_path)
    data = json.loads(gzip.open(tmp_path / "t.json.gz").read())
    steps = [e for e in data["traceEvents"] if str(e.get("name", "")).startswith("ProfilerStep#")]
    assert len(steps) == 2
    assert not list(tmp_path.glob("*.partial.*"))


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    out = tmp_path_factory.mktemp("k")
    job = dataclasses.replace(load_job(TINY), out_dir=str(out))
    base = baseline.run(job)
    return job, base, kernels.run(job)


def test_run_writes_result_trace_and_index(ran):
    job, _, r = ran
    folder = job.step_dir("03_kernels")
    assert (folder / "trace.json.gz").is_file() and r.trace_file == "trace.json.gz"
    d = json.loads((folder / "result.json").read_text())
    again = kernels.KernelsResult.from_dict(d)
    assert again.analysis.top[0] == r.analysis.top[0] and again.ledger.total == pytest.approx(1.0)
    index = (job.output_root() / "index.html").read_text()
    assert "Step 3 · kernels" in index and 'href="03_kernels/trace.json.gz"' in index
    race = d["optimizer_race"]  # raced, or why not: never an empty record read as "an earlier version of the step"
    assert race.get("ran") or race["note"].startswith(("the optimizer step takes", "the trace shows no optimizer"))
    assert "optimizer race: not in this result" not in index.lower()


def test_figures_agree_with_each_other(ran):
    _, base, r = ran
    m = r.metrics
    assert m["profiler_overhead"].value == pytest.approx(
        m["profiled_step_time_median_s"].value / m["step_time_median_s"].value - 1)
    assert r.ledger.total == pytest.approx(1.0)
    assert r.ledger.get("mfu").fraction == pytest.approx(m["profiled_mfu"].value)
    assert m["peak_flops_per_s"].value == base.metric("peak_flops_per_s")  # step 1's peak, reused
    assert m["top_n_share"].value == pytest.approx(sum(t.share for t in r.analysis.top))
    assert len(r.analysis.top) == 20 and r.analysis.kind == "cpu" and r.analysis.steps == 3
    assert m["memory_bandwidth_bytes_per_s"].source == "measured" and m["memory_bandwidth_bytes_per_s"].value > 1e8
    assert r.compare["median_s"] == base.metric("step_time_median_s")
    c = r.compare  # same as step 1 when within its p10-p90 spread, or within 5% of its median
    assert c["consistent"] == (c["p10_s"] <= c["this_median_s"] <= c["p90_s"]
                               or abs(c["this_median_s"] / c["median_s"] - 1) <= 0.05)
    assert c["difference"] == pytest.approx(c["this_median_s"] / c["median_s"] - 1)
    assert any(a.severity == "info" and "Matmuls and attention" in a.message for a in r.advice)


def test_every_rank_of_the_data_parallel_profile_has_its_trace_and_breakdown(ran):
    job, _, r = ran
    d = r.ddp
    assert d["status"] == "ok" and d["world_size"] == 2 and d["backend"] == "gloo"
    assert d["config"] == {"hook": "none", "bucket_mb": 25.0, "grad_as_bucket_view": False}  # no step 2 result
    assert [x.rank for x in d["ranks"]] == [0, 1]
    for x in d["ranks"]:
        assert (job.step_dir("03_kernels") / x.trace_file).is_file()
        assert sum(x.breakdown.parts().values()) == pytest.approx(1.0)
        assert x.breakdown.comm_total > 0  # gloo's all-reduce is in every rank's trace
        assert x.breakdown.communicating <= x.breakdown.comm_total
    assert r.metrics["ddp_exposed_comm_share"].value == max(x.breakdown.communicating for x in d["ranks"])


def test_the_rank_profile_takes_step_2s_recommendation_and_skips_one_process(tiny_job, tmp_path):
    folder = tiny_job.step_dir("02_attention_and_comm")
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"recommendation": {"comm": {
        "hook": "bf16_compress", "bucket_cap_mb": 8, "gradient_as_bucket_view": True}}}))
    assert kernels._comm_config(tiny_job) == (
        {"hook": "bf16_compress", "bucket_mb": 8, "grad_as_bucket_view": True}, "step 2's recommendation")
    one = dataclasses.replace(tiny_job, nproc_per_node=1)
    assert kernels.profile_ranks(one, "cpu", tmp_path, print)["status"] == "skipped"


def test_profile_keys_are_validated():
    with pytest.raises(JobError) as err:
        load_job(TINY, {"profile_steps": 0, "top_n": 0})
    text = str(err.value)
    assert "profile_steps" in text and "top_n" in text


@pytest.mark.e2e
def test_notebook_runs_under_papermill_with_plots_and_an_offline_report(full_run):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    folder = job_root / "03_kernels"
    nb = json.loads((folder / "03_kernels.ipynb").read_text())
    outputs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4  # top kernels, breakdown, ledger, fusion
    text = "".join("".join(o.get("text", "")) for o in outputs)
    assert "USDT:" not in text and "Step 1 median" in text  # compared with step 1, which ran first
    report = (folder / "report.html").read_text()
    assert "add + layer_norm" in report and "these 20 operators" in report
    assert_offline(report)
    index = (job_root / "index.html").read_text()
    assert "Step 3 · kernels" in index and 'href="03_kernels/report.html"' in index
    assert_offline(index)


# ------------------------------------------------------------------ the job in its own layout
LAYOUT_JOB = dict(model="gpt", n_layers=2, n_heads=2, d_model=32, seq_len=16, vocab_size=64, micro_batch=4, steps=2,
                  warmup_steps=1, profile_steps=1, profile_warmup_steps=1, nproc_per_node=2)


def _our_processes():
    import psutil

    return [p for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(scope="module")
def in_layout(tmp_path_factory):
    """Step 3 on the tiny GPT in two layouts at world 2 over gloo: TP2, then FSDP2, one torchrun launch each (the
    loss check, 1 warm-up + 2 timed steps and one traced step per rank). Both together: 33 s here on 2 cores, 69 s
    while others shared them."""
    out = tmp_path_factory.mktemp("kl")
    runs = {}
    for name, extra in (("TP2", {"tp": 2}), ("FSDP2", {"dp_mode": "fsdp"})):
        job = load_job(TINY, LAYOUT_JOB | extra | {"job_name": name.lower(), "out_dir": str(out)})
        runs[name] = (job, kernels.run(job))
    return runs


@pytest.mark.e2e
@pytest.mark.parametrize("name,kinds", [("TP2", ["allreduce"]), ("FSDP2", ["allgather", "reduce_scatter"])])
def test_a_layout_job_traces_every_rank_with_collectives_as_categories(in_layout, name, kinds):
    """Each rank of the job's own layout traced, its collectives by kind, the layout ledger; no process left.
    The fixture's two runs take 33-69 s here (see it); the tests themselves, under a second."""
    job, r = in_layout[name]
    assert not _our_processes()  # run_layout ended torchrun and its ranks
    lay = r.layout
    assert lay["name"] == name and lay["world"] == 2 and lay["backend"] == "gloo" and lay["status"] == "ok"
    assert lay["loss_check"]["passed"] and r.ddp["status"] == "skipped"
    assert any(s["what"] == "one-process profile" for s in r.skipped)
    folder = job.step_dir("03_kernels")
    assert [p.rank for p in lay["profiles"]] == [0, 1]
    for p in lay["profiles"]:
        assert (folder / p.trace_file).is_file() and p.trace_file.startswith("layout/trace_0_rank")
        b = p.breakdown
        assert sum(b.parts().values()) == pytest.approx(1.0)
        assert any(b.comm_by_kind.get(k, {}).get("total", 0) > 0 for k in ("allreduce", "allgather"))
        for k in kinds:
            assert b.comm_by_kind[k]["total"] > 0 and 0 <= b.comm_by_kind[k]["exposed"] <= b.comm_by_kind[k]["total"]
        assert p.top and p.top_share > 0  # its own top operators, from its own trace
    assert r.trace_file == lay["profiles"][0].trace_file and r.analysis.top  # rank 0's trace is the main analysis
    assert r.ledger.total == pytest.approx(1.0)
    structure = r.ledger.get("structure")
    worst = max(lay["profiles"], key=lambda p: p.breakdown.communicating)
    assert lay["most_exposed_rank"] == worst.rank
    assert structure.fraction == pytest.approx(sum(v["exposed"] for v in worst.breakdown.comm_by_kind.values()))
    assert all(k in structure.explanation for k in kinds) and kernels.kl.GLOO_NOTE in structure.explanation
    assert r.ledger.get("mfu").fraction == pytest.approx(r.metric("profiled_mfu"))
    for k in kinds:
        assert r.metric(f"exposed_{k}_share") == worst.breakdown.comm_by_kind[k]["exposed"]
    again = kernels.KernelsResult.from_dict(json.loads((folder / "result.json").read_text()))
    assert again.layout["profiles"][1] == lay["profiles"][1]


@pytest.mark.e2e
def test_a_layout_jobs_report_and_index_say_which_layout_ran(in_layout):
    from mfu_lab import report
    from mfu_lab.report.tables.kernels import compare_line

    job, r = in_layout["TP2"]
    view = report.layout_view(r) + report.ranks_view(r)
    assert "<b>TP2</b>" in view and "allreduce" in view and "gloo&#x27;s collective times on a CPU" in view
    assert "Rank 1 (pp0 dp0 tp1): its top" in view
    assert "TP2" in compare_line(r) and "TP2" in r.ledger_title()
    index = (job.output_root() / "index.html").read_text()
    assert "The job ran in its own layout, <b>TP2</b>" in index and 'href="03_kernels/layout/trace_0_rank1' in index
