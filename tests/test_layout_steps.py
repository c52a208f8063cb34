"""Steps 1 and 7 with the job in its own layout (FSDP2, TP+SP, PP), end to end, and the memory check before a
run. Each launch is a torchrun of 2 gloo ranks on a tiny GPT: about 20-40 s each here (2 shared cores); the file
takes about 2-3 minutes."""

import json

import pytest

from mfu_lab.core.errors import StepError
from mfu_lab.core.job.schema import load_job
from mfu_lab.steps import fit
from mfu_lab.steps.baseline import step as baseline

from .conftest import ROOT, TINY, in_process


def test_steps_1_and_7_run_a_tp_sp_job_in_its_layout_through_papermill(tmp_path):
    p = in_process("run", str(TINY), "--steps", "baseline,verify", "--out", str(tmp_path), "-p", "tp=2", "-p",
                   "sp=true", "-q")
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads((tmp_path / "tiny" / "01_baseline" / "result.json").read_text())
    lay = r["layout"]
    assert lay["layout"]["name"] == "TP2+SP" and lay["world"] == 2 and lay["backend"] == "gloo"
    assert lay["loss_check"]["passed"] and lay["loss_check"]["reference"].startswith("single process")
    assert lay["loss_check"]["max_rel_gap"] <= lay["loss_check"]["tolerance"]
    kinds = {c["kind"]: c for c in lay["collective_rows"]}
    # TP with SP: every all-reduce of the block becomes an all-gather + a reduce-scatter (analysis.layouts.terms)
    assert kinds["allgather"]["count"] > 0 and kinds["reduce_scatter"]["count"] > 0
    # counted bytes equal the closed form exactly: 4 all-gathers + 4 reduce-scatters of b*s*h*4 per layer, 2 more
    # all-gathers at the region's ends, each LayerNorm gradient all-reduced once
    assert [c["ratio"] for c in lay["collective_rows"]] == [pytest.approx(1.0)] * 3
    assert len(lay["ranks"]) == 2 and all(x["peak_bytes"] > 0 and x["shard_bytes"]["params"] > 0
                                          for x in lay["ranks"])
    ledger = r["ledger"]["items"]
    assert sum(i["fraction"] for i in ledger) == pytest.approx(1.0)
    structure = next(i for i in ledger if i["name"] == "structure")
    assert "allgather" in structure["explanation"] and structure["fraction"] > 0
    assert r["metrics"]["mfu"]["value"] > 0 and "whole CPU" in r["metrics"]["peak_flops_per_s"]["note"]
    assert r["fit"]["checked"] and r["fit"]["bytes_per_rank"] < r["fit"]["available_per_rank"]
    report = (tmp_path / "tiny" / "01_baseline" / "report.html").read_text()
    assert "TP2+SP" in report and "Loss check" in report
    assert "TP2+SP" in (tmp_path / "tiny" / "index.html").read_text()
    v = json.loads((tmp_path / "tiny" / "07_verify" / "result.json").read_text())
    assert v["status"] == "ok"


def test_step_1_measures_the_pipeline_bubble_per_stage(tmp_path):
    job = load_job(TINY, {"out_dir": str(tmp_path), "pp": 2, "pp_schedule": "interleaved_1f1b",
                          "pp_virtual_stages": 2, "pp_microbatches": 4, "n_layers": 4, "fp8_layers": ["mlp_up"]})
    r = baseline.run(job, progress=lambda s: None)
    # the ranks convert before the split (core.engine.parallelize): on a CPU they cannot, and the result says why
    assert r.fp8["why_not"].startswith("a CPU has no FP8 matmul units") and r.fp8["groups"] == ["mlp_up"]
    assert {"what": "fp8_layers", "reason": r.fp8["why_not"]} in r.skipped
    b = r.layout["bubble"]
    assert r.layout["layout"]["name"] == "PP2 interleaved_1f1b v2 m4"
    assert b["analytic"] == pytest.approx((2 - 1) / (2 * 4))  # (p-1)/(v*m)
    assert b["analytic_of_step"] == pytest.approx((2 - 1) / (2 * 4 + 2 - 1))  # the same bubble as a share of the step
    assert [r["pp_rank"] for r in b["per_pp_rank"]] == [0, 1]
    assert len(b["per_stage"]) >= 2 and all(0 <= s["fraction"] < 1 for s in b["per_stage"])
    assert r.metrics["pipeline_bubble"].source == "measured"
    p2p = {c["kind"]: c for c in r.layout["collective_rows"]}
    assert p2p["send"]["count"] == 12 and p2p["send"]["ratio"] == pytest.approx(1.0)  # 2m(pv-1)/p on rank 0
    assert any("untied" in n for n in r.layout["notes"])  # the tied head cannot be tied across stages


def test_a_job_that_does_not_fit_is_told_which_layouts_would_before_anything_is_allocated(tmp_path):
    big = load_job(TINY, {"out_dir": str(tmp_path), "n_layers": 32, "n_heads": 32, "d_model": 4096,
                          "vocab_size": 32000, "seq_len": 2048, "micro_batch": 4, "dtype": "bfloat16"})
    with pytest.raises(StepError) as e:
        fit.check_fit(big, "cuda", 8, available=(80 * 2 ** 30, "8 x 80 GB"))
    msg = str(e.value)
    assert "does not fit its layout DDP8" in msg and "fsdp" in msg and "GiB per rank" in msg
    with pytest.raises(StepError) as e:  # through step 1 on this machine: refused before a model is built
        baseline.run(big, progress=lambda s: None, write=False)
    assert "does not fit" in str(e.value)
    assert not (tmp_path / "tiny" / "01_baseline" / "result.json").exists()


def test_step_2_times_attention_and_leaves_ddp_settings_alone_for_a_job_in_a_layout(tmp_path):
    from mfu_lab.steps.attention_comm import step as attention_comm

    job = load_job(TINY, {"out_dir": str(tmp_path), "dp_mode": "fsdp"})
    r = attention_comm.run(job, progress=lambda s: None, write=False)
    assert r.attention and all(row.status != "ok" for row in r.comm)  # nothing of DDP's was launched
    why = next(s["reason"] for s in r.skipped if s["what"] == "DDP sweep and all-reduce benchmark")
    assert "FSDP2" in why and "DDP's buckets and hooks" in why


def test_the_readmes_llama_7b_job_validates_and_fits_fsdp8_not_ddp8_on_h200s():
    """The README's example: a transformers Llama of Llama-2 7B's shape, sized on the meta device (~5 s)."""
    import dataclasses

    job = load_job(ROOT / "parameters" / "llama7b_8gpu.yaml")
    h200 = (140e9, "an H200's free memory")
    r = fit.check_fit(job, "cuda", 8, available=h200)
    assert r["layout"].startswith("FSDP8") and r["params"] == 6_738_415_616
    assert r["by_kind"]["params"] == pytest.approx(6_738_415_616 * 4 / 8)  # float32 master weights, sharded 8 ways
    with pytest.raises(StepError, match="does not fit its layout DDP8.*fsdp8"):
        fit.check_fit(dataclasses.replace(job, dp_mode="ddp", fsdp_param_dtype="", fsdp_reduce_dtype=""), "cuda", 8,
                      available=h200)


def test_step_1s_collective_table_keeps_fp8_scales_max_all_reduces_out_of_the_tp_closed_form():
    """A tp-2 step with fp8_layers, as tests/fixtures/tp_fp8_ranks.py counted it (test_fp8_apply): TP's 8
    all-reduces equal the closed form; the scales' 36 max all-reduces get their own row, said to be outside it."""
    import dataclasses
    from types import SimpleNamespace

    from mfu_lab.core.engine.layout import Layout
    from mfu_lab.steps.baseline import layout as bl

    job = dataclasses.replace(load_job(TINY), tp=2, fp8_layers=["mlp_up"])
    bsh = job.micro_batch * job.seq_len * job.d_model * 4
    run = SimpleNamespace(collectives=[{"allreduce": {"count": 8, "bytes": 8 * bsh},
                                        "allreduce_max": {"count": 36, "bytes": 288}}],
                          layout=dataclasses.asdict(Layout.from_job(job, 2)))
    rows = {r["kind"]: r for r in bl.collective_rows(run, job)}
    assert rows["allreduce"]["ratio"] == pytest.approx(1.0)
    assert rows["allreduce_max"]["formula_bytes"] is None and rows["allreduce_max"]["ratio"] is None
    assert rows["allreduce_max"]["formula"].startswith("all-reduces that take a max, not in the closed form: with "
                                                       "fp8_layers under tensor parallel, torchao's FP8 scales")
    plain = dataclasses.replace(job, fp8_layers=[])  # no FP8: a max all-reduce is the job's own (a norm's max)
    assert {r["kind"]: r for r in bl.collective_rows(run, plain)}["allreduce_max"]["formula"] == bl.MAX_ROW
