"""The layout terms' closed forms against hand-worked values, the memory per rank against the placement model's, and
a 7B-shaped job sized on the meta device told which layouts of 8 x 80 GB fit. No launch; about 10 s here (the
7B Llama built on the meta device takes most of it). The counted side is tests/test_commcount.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from mfu_lab.analysis.layouts import terms as lt
from mfu_lab.analysis.placement import model as pl
from mfu_lab.core.engine.meta_shape import job_shape
from mfu_lab.core.job.schema import Job


def llama_7b():
    """A model factory for the job: Llama-2 7B's shape (transformers' LlamaConfig)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                        intermediate_size=11008, vocab_size=32000))


# ------------------------------------------------------------------ collectives
def test_data_parallel_bytes_by_hand():
    assert lt.ddp_all_reduce_bytes(1000, 4) == 4000
    # 100 parameters, 20 of them the root's: blocks gathered twice, the unresharded root once
    assert lt.fsdp_all_gather_bytes(100, 4, True, root_params=20) == (80 * 2 + 20) * 4 == 720
    assert lt.fsdp_all_gather_bytes(100, 4, False, root_params=20) == 400
    assert lt.fsdp_all_gather_bytes(100, 4, True, root_params=20, root_reshards=True) == 800
    assert lt.fsdp_all_gather_bytes(100, 2, True) == 400  # bf16 param_dtype, every group resharded
    assert lt.fsdp_reduce_scatter_bytes(100, 4) == 400 and lt.fsdp_reduce_scatter_bytes(100, 2) == 200


def test_tensor_parallel_bytes_by_hand():
    assert lt.tp_collectives_per_layer() == {"allreduce": 4}
    assert lt.tp_collectives_per_layer(checkpointing=True) == {"allreduce": 5}
    assert lt.tp_collectives_per_layer(checkpointing=True, early_stop=False) == {"allreduce": 6}
    assert lt.tp_collectives_per_layer(sp=True) == {"allgather": 4, "reduce_scatter": 4}
    assert lt.tp_collectives_per_layer(sp=True, checkpointing=True) == {"allgather": 6, "reduce_scatter": 5}
    assert lt.tp_collectives_per_layer(True, True, False) == {"allgather": 6, "reduce_scatter": 6}
    bsh = 8 * 1024 * 4096 * 2  # b=8, s=1024, h=4096 in bf16: 64 MiB per collective
    assert lt.tp_bytes_per_layer(8, 1024, 4096, 2) == {"allreduce": 4 * bsh}
    # SP: the same volume, as an all-gather plus a reduce-scatter
    assert lt.tp_bytes_per_layer(8, 1024, 4096, 2, sp=True) == {"allgather": 4 * bsh, "reduce_scatter": 4 * bsh}
    assert lt.sp_boundary_bytes(8, 1024, 4096, 2) == {"allgather": 2 * bsh}
    assert lt.sp_norm_grad_all_reduces(16, 16 * 32) == {"count": 48, "bytes": 48 * 32 * 4}


def test_pipeline_sends_and_bubble_by_hand():
    assert lt.p2p_sends_per_rank(2, 4, 2) == 12  # FIELD-NOTES: interleaved 1F1B at p=2, v=2, m=4
    assert lt.p2p_sends_per_rank(2, 4) == 4
    assert [lt.p2p_sends_of_rank(r, 4, 8) for r in range(4)] == [8, 16, 16, 8]  # the ends send one way only
    assert lt.p2p_sends_per_rank(4, 8) == 2 * 8 * 3 / 4 == 12
    # interleaved p=2, v=2: rank 0 holds stages 0 and 2 (0 sends forward only), rank 1 stages 1 and 3
    assert [lt.p2p_sends_of_rank(r, 2, 4, 2) for r in range(2)] == [12, 12]
    assert lt.p2p_send_bytes(2, 1024, 4096, 2) == 2 * 1024 * 4096 * 2
    assert lt.p2p_send_bytes(2, 1024, 4096, 2, tp=4, sp=True) == 2 * 1024 * 4096 * 2 / 4
    assert lt.bubble_fraction(4, 8) == 3 / 8 and lt.bubble_fraction(2, 4, 2) == 1 / 8


# ------------------------------------------------------------------ memory
def _shape(**kw):
    return lt.memory_shape(**({"params": 1e9, "n_layers": 8, "n_heads": 8, "d_model": 1024, "seq_len": 1024,
                               "micro_batch": 4, "act_bytes": 2} | kw))


SBH = 1024 * 4 * 1024


def test_memory_per_rank_by_hand():
    fsdp = lt.memory_per_rank(_shape(), SimpleNamespace(dp_mode="fsdp", dp=8, tp=1, pp=1))
    per_layer = SBH * (8 + 24) * 2 / 2  # s*b*h*(8 + 24/t)*bytes/2 at t=1, bf16
    assert fsdp["params"].value == 4e9 / 8 and fsdp["grads"].value == 4e9 / 8
    assert fsdp["optimizer"].value == 8e9 / 8 and fsdp["ddp_buckets"].value == 0
    assert fsdp["activations"].value == 8 * per_layer
    assert fsdp["total"].value == 16e9 / 8 + 8 * per_layer
    assert {m.source for m in fsdp.values()} == {"analytic"} and fsdp["total"].unit == "bytes"
    ddp = lt.memory_per_rank(_shape(), SimpleNamespace(dp_mode="ddp", dp=8, tp=1, pp=1))
    assert ddp["total"].value == 20e9 + 8 * per_layer  # 16 B/param + DDP's bucket copy (4)
    view = lt.memory_per_rank(_shape(grad_as_bucket_view=True), SimpleNamespace(dp_mode="ddp", dp=8, tp=1, pp=1))
    assert view["total"].value == 16e9 + 8 * per_layer
    # TP2 x PP2 x FSDP2, 4 micro-batches of 1 sample, 1F1B: 2 in flight on stage one, 4 layers per stage
    tp_pp = lt.memory_per_rank(_shape(), SimpleNamespace(dp_mode="fsdp", dp=2, tp=2, pp=2, pp_microbatches=4))
    per_mb = SBH / 4 * (8 + 24 / 2) * 2 / 2
    assert tp_pp["total"].value == pytest.approx(16e9 / 8 + 4 * per_mb * 2)
    gpipe = lt.memory_per_rank(_shape(), SimpleNamespace(dp_mode="fsdp", dp=2, tp=2, pp=2, pp_microbatches=4,
                                                         pp_schedule="gpipe"))
    assert gpipe["activations"].value == pytest.approx(4 * per_mb * 4)  # GPipe: all m in flight


def test_memory_per_rank_is_the_placement_models():
    s = _shape(checkpointing=True)
    lay = SimpleNamespace(dp_mode="fsdp", dp=4, tp=2, pp=2, pp_microbatches=4, sp=True)
    model = pl.memory_bytes(dataclasses.replace(s, micro_batch=1, sequence_parallel=True),
                            pl.Layout(2, 2, 4, 4, fsdp=True))
    assert lt.memory_per_rank(s, lay)["total"].value == pytest.approx(model)


def test_placement_models_fsdp_term_is_off_by_default():
    s = dataclasses.replace(_shape(), flops_per_sample=6e9 * 1024)
    lay = pl.Layout(tp=2, pp=2, dp=4, m=8)
    per_layer = SBH * (8 + 24 / 2)
    assert pl.memory_bytes(s, lay) == pytest.approx(20e9 / 4 + 4 * per_layer * 2)  # step 6's figure, unchanged
    sharded = dataclasses.replace(lay, fsdp=True)
    assert pl.memory_bytes(s, sharded) == pytest.approx(16e9 / 16 + 4 * per_layer * 2)
    assert pl.state_bytes(s, sharded) == {"params": 4e9 / 16, "grads": 4e9 / 16, "optimizer": 8e9 / 16,
                                          "ddp_buckets": 0.0}
    assert sharded.label() == "TP2 PP2 FSDP4 m8" and lay.label() == "TP2 PP2 DP4 m8"


def test_parameters_outside_the_blocks_stay_whole_under_tp_and_a_pipeline_adds_the_untied_head():
    s = dataclasses.replace(_shape(), root_params=1e8, pp_head_params=4e7)  # 9e8 in the blocks
    tp = pl.state_bytes(s, pl.Layout(tp=2, pp=1, dp=1, m=1))
    assert tp["params"] == pytest.approx(4 * (9e8 / 2 + 1e8))
    pp = pl.state_bytes(s, pl.Layout(tp=1, pp=2, dp=1, m=4))  # the mean rank: half the blocks, half of root + head
    assert pp["params"] == pytest.approx(4 * (9e8 / 2 + (1e8 + 4e7) / 2))
    fsdp = pl.state_bytes(s, pl.Layout(tp=2, pp=2, dp=2, m=4, fsdp=True))
    assert fsdp["optimizer"] == pytest.approx(8 * (9e8 / 4 + 1.4e8 / 2) / 2)
    assert pl.state_bytes(_shape(), pl.Layout(tp=2, pp=2, dp=1, m=4))["params"] == pytest.approx(4 * 1e9 / 4)
    note = lt.memory_per_rank(s, SimpleNamespace(dp_mode="ddp", dp=1, tp=1, pp=2, pp_microbatches=4))["params"].note
    assert "100,000,000 parameters outside the blocks whole under TP" in note and "untied head's 40,000,000" in note


def test_sequence_parallel_activations_as_measured():
    s = _shape(act_bytes=4)  # float32, as the trial measured
    sbh = SBH
    sp = pl.activation_bytes_per_layer(dataclasses.replace(s, sequence_parallel=True), 2)
    assert sp == 36 * sbh  # Korthikanti's 32 + the gathered attention input (4)
    assert sp / sbh == pytest.approx(36.25, rel=0.01)  # FIELD-NOTES: 36.25 s*b*h measured at t=2
    assert pl.activation_bytes_per_layer(s, 2) == sbh * (8 + 24 / 2) * 4 / 2 == 40 * sbh


# ------------------------------------------------------------------ a 7B job
@pytest.fixture(scope="module")
def llama() -> lt.pl.Shape:
    meta = job_shape(Job(model=f"{__name__}:llama_7b"))
    assert meta.params == pytest.approx(6.74e9, rel=0.01)  # Llama-2 7B: 6,738,415,616
    assert (meta.n_layers, meta.d_model, meta.n_heads, meta.vocab_size) == (32, 4096, 32, 32000)
    return lt.memory_shape(meta.params, meta.n_layers, meta.n_heads, meta.d_model, seq_len=2048, micro_batch=4,
                           act_bytes=2)


def test_meta_shape_of_the_reference_gpt():
    meta = job_shape(Job())  # V=2048, h=256, 4 blocks, s=256, tied head
    block = 2 * 2 * 256 + (256 * 768 + 768) + (256 * 256 + 256) + (256 * 1024 + 1024) + (1024 * 256 + 256)
    assert meta.params == 2048 * 256 + 256 * 256 + 4 * block + 2 * 256 == 3_749_376
    assert (meta.n_layers, meta.d_model, meta.n_heads, meta.vocab_size, meta.param_bytes) == (4, 256, 4, 2048, 4)


def test_a_7b_job_on_8_x_80gb(llama):
    fit = lt.layouts_that_fit(llama, 8, 80e9)
    names = [c["name"] for c in fit]
    every = {c["name"]: c for c in lt.candidate_layouts(llama, 8)}
    assert "ddp8" not in names and every["ddp8"]["bytes_per_rank"] > 16 * 6.7e9  # 107 GB of state alone
    assert "fsdp8" in names
    p = 6_738_415_616
    acts = 32 * 2048 * 4 * 4096 * (8 + 24) * 2 / 2  # 32 layers, s=2048, b=4, bf16
    fsdp8 = every["fsdp8"]["memory"]
    assert fsdp8["total"].value == pytest.approx(16 * p / 8 + acts)  # 13.5 GB of state + 34.4 GB of activations
    assert fsdp8["total"].value == pytest.approx(47.84e9, rel=1e-3)
    assert all(c["bytes_per_rank"] <= 80e9 for c in fit)
    assert [c["bytes_per_rank"] for c in fit] == sorted(c["bytes_per_rank"] for c in fit)
    assert {"tp2-fsdp4", "pp2-fsdp4", "tp8"} <= set(names)
    # PP splits the micro-batch of 4 into 4 micro-batches of 1; a micro-batch of 1 cannot be split
    assert not [c for c in lt.candidate_layouts(dataclasses.replace(llama, micro_batch=1), 8) if c["pp"] > 1]


def test_candidates_respect_heads_and_layers():
    s = _shape(n_heads=6, n_layers=3, micro_batch=4)
    got = {(c["tp"], c["pp"], c["dp_mode"]) for c in lt.candidate_layouts(s, 8)}
    assert got == {(1, 1, "ddp"), (1, 1, "fsdp"), (2, 1, "ddp"), (2, 1, "fsdp")}  # tp | 6 and 8; pp | 3 and 8
    assert lt.layout_name("fsdp", 4, 2, 1) == "tp2-fsdp4" and lt.layout_name("ddp", 1, 8, 1) == "tp8"
