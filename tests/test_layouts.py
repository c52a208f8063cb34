"""The job in its layout, for real: gloo ranks through torchrun on CPU (world 2; world 4 for the 2-D mesh).

Correctness only: each layout's loss over its first steps equals one process's on the same seed and batches
(mfu_lab.workers.layout_rank.TOLERANCE), and the counted collectives, memory and bubble come back filled.
Several layouts share one launch. 1.5 to 2.5 minutes here (88 s to 135 s on 2 shared cores): 7 launches of 7-35 s.
"""

import dataclasses
import json

import psutil
import pytest

from mfu_lab.core.engine.layout import Layout
from mfu_lab.core.job.schema import validate
from mfu_lab.workers.layout_launch import LayoutRun, run_layout, run_layouts
from mfu_lab.workers.layout_rank import TOLERANCE

pytestmark = pytest.mark.e2e

TINY = dict(job_name="layouts", n_layers=4, n_heads=4, d_model=32, seq_len=16, vocab_size=64, micro_batch=4,
            steps=2, warmup_steps=1, comm_timeout_s=60.0, nproc_per_node=2)
B, S, H, L = 4, 16, 32, 4  # micro_batch, seq_len, d_model, n_layers
LLAMA = "tests.test_layouts:tiny_llama"
SLOW = 0.1  # s, slept in each backward of the first pipeline stage's first block (an injected fault)


def tiny_llama():
    """A Llama-style model as transformers builds it, tiny and local (no download): 2 layers, 4 heads (2 KV)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16, use_cache=False)
    return LlamaForCausalLM(cfg)


def job(**kw):
    return validate(TINY | kw, "test")


def item(**overrides):
    return {"overrides": overrides}


def ours() -> list[psutil.Process]:
    """Processes this test process started that are still alive (torchrun, its ranks)."""
    return [p for p in psutil.Process().children(recursive=True) if p.is_running()
            and p.status() != psutil.STATUS_ZOMBIE]


def assert_equal_loss(r: LayoutRun):
    assert r.status == "ok", (r.name, r.reason, r.stderr[-2000:])
    c = r.loss_check
    assert c["passed"] and c["steps"] == 3 and len(c["layout_losses"]) == 3
    assert c["max_rel_gap"] <= TOLERANCE["float32"] if r.layout["param_dtype"] == "float32" else True
    print(f"{r.name}: gap {c['max_rel_gap']:.1e} against {c['reference']}")


def test_layout_names_and_degrees():
    assert Layout.from_job(job(), 2).name == "DDP2" and Layout.from_job(job(), 2).is_plain_ddp
    assert Layout.from_job(job(dp_mode="fsdp", fsdp_reshard_after_forward=False), 2).name == "FSDP2 no-reshard"
    assert Layout.from_job(job(tp=2, sp=True), 2).name == "TP2+SP"
    lay = Layout.from_job(job(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=4), 2)
    assert lay.name == "PP2 interleaved_1f1b v2 m4" and lay.dp == 1 and lay.stages == 4
    assert Layout.from_job(job(dp_mode="fsdp", tp=2), 4).name == "FSDP2xTP2"
    assert Layout.from_job(job(dp_mode="fsdp", dtype="bfloat16"), 2).param_dtype == "bfloat16"
    assert json.loads(json.dumps(lay.to_dict()))["pp_virtual_stages"] == 2


def test_data_parallel_layouts_match_one_process(tmp_path):
    """DDP2 and FSDP2 (reshard on and off, explicit prefetch, bf16 MixedPrecisionPolicy) in one launch."""
    runs = run_layouts(job(), "cpu", tmp_path, [
        item(), item(dp_mode="fsdp"), item(dp_mode="fsdp", fsdp_reshard_after_forward=False),
        item(dp_mode="fsdp", fsdp_prefetch=1), item(dp_mode="fsdp", dtype="bfloat16")])
    ddp, fsdp, noreshard, prefetch, bf16 = runs
    for r in runs:
        assert_equal_loss(r)
    assert bf16.loss_check["tolerance"] == TOLERANCE["bfloat16"]
    assert any("MixedPrecisionPolicy replaces autocast" in n for n in bf16.notes)
    params = ddp.memory[0]["shard_bytes"]["params"]
    for r in (fsdp, noreshard, prefetch):  # FSDP2 holds half of everything at world 2
        sb = r.memory[0]["shard_bytes"]
        assert sb["params"] == pytest.approx(params / 2, rel=0.01) and sb["grads"] == sb["params"]
        assert r.collectives[0]["reduce_scatter"]["bytes"] == params  # the whole gradient, once
    # reshard after forward gathers the parameters twice (forward and backward), without once
    assert fsdp.collectives[0]["allgather"]["bytes"] == 2 * params
    assert noreshard.collectives[0]["allgather"]["bytes"] == params
    assert ddp.collectives[0]["allreduce"]["bytes"] >= params


def test_tensor_and_pipeline_layouts_match_one_process(tmp_path):
    """TP2, TP2+SP, PP2 (gpipe, 1f1b, interleaved v2), a tiny Llama under TP2, TP2 checked against FSDP2, and a
    layout whose loss differs (refused), in one launch."""
    pp = dict(pp=2, pp_microbatches=4)
    runs = run_layouts(job(), "cpu", tmp_path, [
        item(tp=2), item(tp=2, sp=True), item(**pp, pp_schedule="gpipe"), item(**pp, pp_schedule="1f1b"),
        item(**pp, pp_schedule="interleaved_1f1b", pp_virtual_stages=2),
        item(model=LLAMA, tp=2),
        {"overrides": {"tp": 2}, "reference": {"dp_mode": "fsdp"}}, item(dp_mode="fsdp")],
        fault=[{"layout": 7, "kind": "perturb"}, {"layout": 2, "rank": 0, "kind": "slow_backward", "seconds": SLOW}])
    tp, sp, gpipe, f1b, inter, llama, tp_vs_fsdp, perturbed = runs
    for r in runs[:7]:
        assert_equal_loss(r)
    act = B * S * H * 4  # one activation, float32 bytes
    assert tp.collectives[0] == {"allreduce": {"count": 4 * L, "bytes": 4 * L * act}}  # 2 forward, 2 backward
    c = sp.collectives[0]  # SP: each all-reduce becomes an all-gather plus a reduce-scatter of the same volume
    assert c["reduce_scatter"] == {"count": 4 * L, "bytes": 4 * L * act}
    assert c["allgather"]["count"] == 4 * L + 2  # + the residual stream's gather before ln_f and its backward
    assert any("foreach=False" in n for n in tp.notes)
    for r in (gpipe, f1b, inter):
        assert any("lm_head untied" in n for n in r.notes) and r.bubble["per_stage"]
        assert all(0 <= s["fraction"] < 1 for s in r.bubble["per_stage"])
    # the last rank's drain is its wait for stage 0's last backward, slowed by SLOW: in its step, not after it
    assert gpipe.bubble["per_pp_rank"][-1]["drain_s"] >= SLOW
    assert gpipe.bubble["per_pp_rank"][-1]["fraction"] > gpipe.bubble["per_pp_rank"][0]["fraction"]
    assert gpipe.collectives[0]["send"]["count"] == 4  # m activations forward (rank 0) or gradients back
    assert inter.collectives[0]["send"]["count"] == 2 * 4 * (2 * 2 - 1) // 2  # 2m(pv-1)/p
    assert inter.bubble["analytic"] == pytest.approx(1 / 8) and len(inter.bubble["per_stage"]) == 4
    assert llama.collectives[0]["allreduce"]["count"] == 4 * 2  # 2 layers
    assert tp_vs_fsdp.loss_check["reference"] == "layout FSDP2"
    assert perturbed.status == "refused" and "above the tolerance" in perturbed.reason
    assert perturbed.loss_check["max_rel_gap"] > TOLERANCE["float32"] and not perturbed.step_times_s


def test_fsdp_x_tp_on_a_2x2_mesh(tmp_path):
    (r,) = run_layouts(job(nproc_per_node=4), "cpu", tmp_path, [item(dp_mode="fsdp", tp=2)])
    assert r.name == "FSDP2xTP2" and r.world == 4
    assert_equal_loss(r)
    kinds = set(r.collectives[0])
    assert {"allgather", "reduce_scatter", "allreduce"} <= kinds


def test_run_layout_fills_every_field_and_leaves_no_process(tmp_path):
    j = job(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2, pp_microbatches=4)
    r = run_layout(j, "cpu", tmp_path, profile=True, steps=2)
    assert r.status == "ok" and r.reason == "" and r.backend == "gloo" and r.threads_per_rank >= 1
    assert r.layout["name"] == "PP2 interleaved_1f1b v2 m4" and r.world == 2
    assert len(r.step_times_s) == 2 and all(len(t) == 2 and min(t) > 0 for t in r.step_times_s)
    assert r.tokens_per_step == B * S and len(r.losses) == 2
    assert r.loss_check["passed"] and r.loss_check["reference"] == "single process, global batch"
    assert all(c["send"]["bytes"] > 0 for c in r.collectives)
    assert all(m["peak_bytes"] > 0 and m["peak_source"] and m["shard_bytes"]["optimizer"] > 0 for m in r.memory)
    assert r.bubble["per_stage"] and r.bubble["per_pp_rank"] and r.notes
    assert len(r.trace_paths) == 2 and all(p.endswith(".json.gz") for p in r.trace_paths)
    back = LayoutRun.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and back.step_s() > 0
    assert not ours()


def test_a_crash_is_recorded_the_next_layout_runs_and_no_process_is_left(tmp_path):
    j = dataclasses.replace(job(), steps=2)
    crashed, after = run_layouts(j, "cpu", tmp_path, [item(tp=2), item()],
                                 fault=[{"layout": 0, "rank": 1, "kind": "crash"}])
    assert crashed.status == "crashed" and "injected crash on rank 1" in crashed.reason
    assert crashed.name == "TP2" and not crashed.step_times_s
    assert after.status == "ok" and after.name == "DDP2"
    assert not ours()


def test_a_hang_is_ended_by_the_watchdog_and_no_process_is_left(tmp_path):
    (r,) = run_layouts(job(comm_timeout_s=6.0), "cpu", tmp_path, [item(dp_mode="fsdp")],
                       fault=[{"layout": 0, "rank": 0, "kind": "hang"}])
    assert r.status == "hung" and "no progress for 6 s" in r.reason and "rank 0" in r.reason
    assert not ours()


def test_split_qkv_keeps_the_results_and_the_flops():
    import torch

    from mfu_lab.core.engine.workload import build_model

    j = job()
    fused, split = build_model(j), build_model(j)
    n = fused.matmul_params()
    for block in split.blocks:
        block.attn.split_qkv()
    x = torch.randint(64, (2, 16))
    assert torch.allclose(fused(x), split(x), atol=1e-6) and split.matmul_params() == n


def test_ddp_and_fsdp2_accumulate_grad_accum_micro_batches_per_timed_step(tmp_path):
    """grad_accum 2 in the job's own layouts: each timed step holds two micro-batches (its tokens twice one's),
    DDP under no_sync and FSDP2 without gradient sync until the last; the loss check still passes."""
    runs = run_layouts(job(grad_accum=2), "cpu", tmp_path, [item(), item(dp_mode="fsdp")])
    for r in runs:
        assert_equal_loss(r)
        assert r.tokens_per_step == 2 * 2 * B * S  # grad_accum x data-parallel ranks x micro_batch x seq_len
        assert len(r.step_times_s[0]) == 2 and len(r.losses) == 2
    assert not ours()
