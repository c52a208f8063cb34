"""Trace analysis against a committed real CPU trace and a hand-written GPU trace.

tests/data/cpu_trace.json.gz is one profiled training step of a one-layer GPT
(d_model 16, 2 heads, seq 8, batch 2, vocab 32, tied embeddings: 16 parameter
tensors), written by tools/make_trace_fixture.py. The expected counts below
follow from that shape, not from running the analysis.
"""

import gzip
import json

import pytest

from mfu_lab.analysis.trace import breakdown as tr

from .conftest import ROOT

CPU_TRACE = ROOT / "tests" / "data" / "cpu_trace.json.gz"


@pytest.fixture(scope="module")
def cpu():
    return tr.analyse(tr.load_trace(CPU_TRACE), top_n=200, bandwidth=1e10)


def raw_events():
    return json.loads(gzip.open(CPU_TRACE).read())["traceEvents"]


def span(prefix):
    return next(e for e in raw_events() if e["name"].startswith(prefix))["dur"]


def row(analysis, name, category=None):
    return next(r for r in analysis.top if r.name == name and (category is None or r.category == category))


def roots(events):
    """Operators not nested inside another operator (one thread), found by brute-force containment."""
    ops = [e for e in events if e["cat"] == "cpu_op"]
    eps = 1e-6  # the fixture's times are rounded to 0.1 us

    def inside(o, p):
        return p["ts"] - eps <= o["ts"] and o["ts"] + o["dur"] <= p["ts"] + p["dur"] + eps and p["dur"] > o["dur"]

    return [o for o in ops if not any(p is not o and inside(o, p) for p in ops)]


def test_cpu_trace_window_and_counts_follow_from_the_model(cpu):
    assert cpu.kind == "cpu" and cpu.steps == 1
    assert cpu.window_s == pytest.approx(span("ProfilerStep#") * 1e-6)
    addmm = row(cpu, "aten::addmm")
    assert (addmm.calls, addmm.category) == (4, "matmul")  # qkv, proj, fc, fc2
    assert addmm.shapes.startswith("48 float, 16x16 float, 16x48 float")  # qkv: bias, 2x8 tokens x d, W^T
    # lm_head forward 1 + its backward 2 + the four addmm backwards 2 each = 11
    assert (row(cpu, "aten::mm").calls, row(cpu, "aten::mm").category) == (11, "matmul")
    gelu = row(cpu, "aten::gelu")
    assert (gelu.calls, gelu.category, gelu.shapes) == (1, "elementwise", "2x8x64 float")
    ln_bwd = row(cpu, "aten::native_layer_norm_backward")
    assert (ln_bwd.calls, ln_bwd.category) == (3, "normalisation")  # ln1, ln2, ln_f
    assert row(cpu, "aten::_scaled_dot_product_flash_attention_for_cpu").category == "attention"
    assert row(cpu, "aten::mul_", "optimizer").calls > 0  # AdamW's in-place ops, inside Optimizer.step


def test_cpu_table_adds_up_to_the_time_inside_operators(cpu):
    events = raw_events()
    # the self times of all operators add up to their roots' time
    inside = sum(o["dur"] for o in roots(events)) / span("ProfilerStep#")
    assert cpu.top_share + cpu.rest_share == pytest.approx(inside, rel=1e-9)
    cut = tr.analyse(tr.load_trace(CPU_TRACE), top_n=5)
    assert len(cut.top) == 5 and cut.rest_count == len(cpu.top) - 5
    assert cut.top_share + cut.rest_share == pytest.approx(inside, rel=1e-9)
    assert [r.total_s for r in cut.top] == sorted((r.total_s for r in cut.top), reverse=True)
    assert sum(cpu.category_share.values()) == pytest.approx(inside, rel=1e-9)


def test_cpu_breakdown_is_a_partition_of_the_window(cpu):
    b = cpu.breakdown
    assert sum(b.parts().values()) == pytest.approx(1.0, abs=1e-12)
    events = raw_events()
    loader = next(e for e in events if e["name"].startswith("enumerate(DataLoader)"))
    lo, hi = loader["ts"], loader["ts"] + loader["dur"]
    rs = roots(events)
    working = sum(r["dur"] for r in rs if not lo <= r["ts"] < hi)
    window = span("ProfilerStep#")
    assert b.computing + b.copying == pytest.approx(working / window, rel=1e-9)
    # on a CPU the loader's own operators (randint, stack) are not training work: the whole span is a data wait
    assert b.waiting_for_data == pytest.approx(loader["dur"] / window, rel=1e-9)
    assert b.communicating == b.comm_total == 0.0


def test_cpu_fusion_candidates_and_their_traffic(cpu):
    by = {c.pattern: c for c in cpu.fusion}
    # residual add + the next LayerNorm: after attention (ln2) and after the MLP (ln_f)
    c = by["add + layer_norm"]
    assert c.per_step == 2 and c.categories == ["elementwise", "normalisation"]
    assert c.saved_bytes_per_step == 2 * 2 * (2 * 8 * 16 * 4)  # 2 runs x (write + read) x 2x8x16 float32
    assert c.est_saving_per_step_s == pytest.approx(c.saved_bytes_per_step / 1e10)
    assert "norm" in c.remedy
    assert "nll_loss_backward + log_softmax_backward" in by  # the loss's backward chain
    assert all(c.saved_bytes_per_step > 0 for c in cpu.fusion)
    assert any("sum + gelu_backward" in n for n in cpu.notes)  # passes nothing along: left out, and said so
    savings = [c.est_saving_per_step_s for c in cpu.fusion]
    assert savings == sorted(savings, reverse=True)


def test_cpu_optimizer_is_found_and_seen_as_per_parameter(cpu):
    opt = cpu.optimizer
    assert opt["found"] and not opt["multi_tensor"]
    assert opt["ops_per_step"] == 160  # 16 parameter tensors x 10 operators of single-tensor AdamW
    assert opt["share_of_step"] == pytest.approx(span("Optimizer.step#") / span("ProfilerStep#"))


# ------------------------------------------------------------------ a hand-written GPU trace
def gpu_trace():
    """Window 0-100 us. Stream 7: gemm 10-30, add 30-35, layer norm 36-40, gemm 45-60. Stream 20: an NCCL
    all-reduce 50-80 (10 us under the second gemm). A host-to-device copy 0-5; the host in the DataLoader 0-8."""
    def op(name, ts, dur, ext, dims=None, types=None):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur,
                "args": {"External id": ext, "Input Dims": dims or [], "Input type": types or []}}

    def kernel(name, ts, dur, ext, stream=7, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
                "args": {"External id": ext, "stream": stream}}

    act = [[4, 8, 16], [4, 8, 16]]
    gemm = "sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32"
    return {"traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1, "ts": 0, "dur": 100},
        {"ph": "X", "cat": "user_annotation", "name": "enumerate(DataLoader)#_MultiProcessingDataLoaderIter.__next__",
         "pid": 1, "tid": 1, "ts": 0, "dur": 8},
        op("aten::addmm", 9, 1, 1, [[16], [32, 16], [16, 16]], ["float", "float", "float"]),
        op("aten::add", 10, 1, 2, act, ["float", "float"]),
        op("aten::native_layer_norm", 11, 1, 3, [[4, 8, 16], [16], [16]], ["float", "float", "float"]),
        op("aten::mm", 12, 1, 4, [[32, 16], [16, 16]], ["float", "float"]),
        kernel("Memcpy HtoD (Pageable -> Device)", 0, 5, 0, cat="gpu_memcpy"),
        kernel(gemm, 10, 20, 1),
        kernel("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 30, 5, 2),
        kernel("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", 36, 4, 3),
        kernel(gemm, 45, 15, 4),
        kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 50, 30, None, stream=20),
    ]}


def test_gpu_breakdown_by_hand():
    a = tr.analyse(gpu_trace(), bandwidth=1e9)
    b = a.breakdown
    assert a.kind == "gpu" and b.window_s == pytest.approx(100e-6)
    assert b.computing == pytest.approx(0.44)  # 20 + 5 + 4 + 15
    assert b.comm_total == pytest.approx(0.30) and b.comm_overlapped == pytest.approx(0.10)
    assert b.communicating == pytest.approx(0.20)  # 60-80: nothing computes under it
    assert b.copying == pytest.approx(0.05)
    assert b.waiting_for_data == pytest.approx(0.03)  # idle 5-8 while the host is in the DataLoader
    assert b.idle == pytest.approx(0.28)  # 8-10, 35-36, 40-45, 80-100
    assert sum(b.parts().values()) == pytest.approx(1.0)
    assert b.comm_by_kind == {"allreduce": {"total": pytest.approx(0.30), "exposed": pytest.approx(0.20)}}


def test_collectives_are_split_by_kind_with_their_exposed_time():
    """Two kinds on their own streams: an all-gather 0-20 wholly exposed, a reduce-scatter 45-65 of which 45-60
    runs under the gemm (5 us exposed); kinds named from NCCL kernels, c10d operators and gloo events alike."""
    t = gpu_trace()
    t["traceEvents"] = [e for e in t["traceEvents"] if "AllReduce" not in e["name"]] + [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "pid": 0, "tid": 21, "ts": 0,
         "dur": 20, "args": {"stream": 21}},
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "pid": 0, "tid": 22,
         "ts": 45, "dur": 20, "args": {"stream": 22}}]
    by_kind = tr.analyse(t).breakdown.comm_by_kind
    assert by_kind["allgather"]["total"] == pytest.approx(0.20)
    assert by_kind["allgather"]["exposed"] == pytest.approx(0.10)  # 10-20 is under the first gemm (10-30)
    assert by_kind["reduce_scatter"] == {"total": pytest.approx(0.20), "exposed": pytest.approx(0.05)}
    assert [tr.comm_kind(n) for n in ("gloo:all_reduce", "c10d::_allgather_base_", "c10d::send", "c10d::recv_",
                                      "c10d::reduce_scatter_tensor_coalesced_", "c10d::broadcast_")] == [
        "allreduce", "allgather", "send", "recv", "reduce_scatter", "broadcast"]
    assert tr.comm_kind("record_param_comms", {"Collective name": "_allgather_base"}) == "allgather"


def test_gpu_top_table_by_hand():
    a = tr.analyse(gpu_trace(), top_n=3)
    assert [(r.name.split("_")[0], r.category, r.calls) for r in a.top] == [
        ("sm90", "matmul", 2), ("ncclDevKernel", "communication", 1), ("Memcpy HtoD (Pageable -> Device)",
                                                                        "memory copy", 1)]
    gemm = a.top[0]
    assert gemm.category == "matmul" and gemm.calls == 2
    assert gemm.total_s == pytest.approx(35e-6) and gemm.mean_s == pytest.approx(17.5e-6)
    assert gemm.share == pytest.approx(0.35) and gemm.launched_by in ("aten::addmm", "aten::mm")
    assert [r.share for r in a.top[1:]] == pytest.approx([0.30, 0.05])
    assert a.top_share == pytest.approx(0.70) and a.rest_share == pytest.approx(0.09) and a.rest_count == 2
    cats = a.category_share
    assert (cats["elementwise"], cats["normalisation"], cats["communication"]) == pytest.approx((0.05, 0.04, 0.30))


def test_gpu_fusion_uses_the_launching_operators_shapes():
    a = tr.analyse(gpu_trace(), bandwidth=1e9)
    assert [c.pattern for c in a.fusion] == ["add + layer_norm"]
    c = a.fusion[0]
    assert c.per_step == 1 and c.time_per_step_s == pytest.approx(9e-6)
    assert c.saved_bytes_per_step == 2 * 4 * 8 * 16 * 4  # the add's output written once and read back once
    assert c.est_saving_per_step_s == pytest.approx(4096 / 1e9)
    assert not a.optimizer["found"]


@pytest.mark.parametrize("name, category", [
    ("aten::addmm", "matmul"), ("AddmmBackward0", "matmul"), ("ampere_sgemm_128x64_tn", "matmul"),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", "matmul"), ("flash_fwd_kernel", "attention"),
    ("aten::_scaled_dot_product_efficient_attention", "attention"), ("aten::native_layer_norm", "normalisation"),
    ("NativeLayerNormBackward0", "normalisation"), ("aten::rms_norm", "normalisation"),
    ("aten::_softmax", "reduction"), ("void at::native::reduce_kernel<512, 1>", "reduction"),
    ("aten::native_dropout", "elementwise"), ("aten::gelu", "elementwise"), ("GeluBackward0", "elementwise"),
    ("aten::copy_", "memory copy"), ("Memcpy DtoD (Device -> Device)", "memory copy"),
    ("aten::embedding", "memory copy"), ("aten::_foreach_mul_", "optimizer"),
    ("multi_tensor_apply_kernel", "optimizer"), ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
    ("gloo:all_reduce", "communication"), ("aten::arange", "other"), ("aten::empty", "other"),
])
def test_categories_from_names(name, category):
    assert tr.categorise(name) == category


def test_short_names():
    assert tr.short_name("NativeLayerNormBackward0") == "layer_norm_backward"
    assert tr.short_name("aten::_log_softmax") == "log_softmax"
    assert tr.short_name("autograd::engine::evaluate_function: GeluBackward0") == "gelu_backward"


def test_a_file_that_is_not_a_trace_is_named_in_the_error(tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text('{"events": []}')
    with pytest.raises(ValueError, match="notes.json: no 'traceEvents' list"):
        tr.load_trace(bad)
    broken = tmp_path / "t.json.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="t.json.gz: not a readable Chrome trace JSON"):
        tr.load_trace(broken)
    with pytest.raises(ValueError, match="no operators or kernels"):
        tr.analyse({"traceEvents": []})


def test_interval_arithmetic():
    assert tr.union([(0, 2), (1, 3), (5, 6)]) == [(0, 3), (5, 6)]
    assert tr.intersect([(0, 10)], [(2, 3), (8, 12)]) == [(2, 3), (8, 10)]
    assert tr.subtract([(0, 10)], [(2, 3), (8, 12)]) == [(0, 2), (3, 8)]
    assert tr.measure(tr.subtract([(0, 10)], [(-1, 11)])) == 0
