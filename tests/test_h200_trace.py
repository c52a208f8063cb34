"""Step 3's reading of the first H200 run's trace (tests/data/h200): the idle share against the step without the
profiler, fusion candidates that hold no matmul or attention, and ``mfu-lab trace`` on a trace the user brings."""

import json
import re

import pytest

from mfu_lab.analysis.trace.breakdown import analyse, idle_share
from mfu_lab.analysis.trace.events import load_trace
from mfu_lab.steps.kernels import step as kernels
from mfu_lab.steps.kernels.figures import trace_metrics

from .conftest import ROOT, in_process

DATA = ROOT / "tests" / "data" / "h200"
TRACE = DATA / "step3_trace.json.gz"
STEP_MS = 48.7  # step 1's (and step 3's) unprofiled median on the H200
DENSE = {"mm", "addmm", "bmm", "matmul", "linear", "cudnn_attention_forward", "cudnn_attention_backward",
         "scaled_dot_product_attention", "_scaled_dot_product_cudnn_attention",
         "_scaled_dot_product_flash_attention", "_efficient_attention_forward"}


@pytest.fixture(scope="module")
def analysis():
    return analyse(load_trace(TRACE))


def _dense(ops):
    return [o for o in ops if o in DENSE or "attention" in o]


def test_no_fusion_candidate_holds_a_matmul_or_attention_and_the_loss_chain_is_one(analysis):
    """cuBLAS 13's mm/addmm and cuDNN's attention launch a memset first: classified by their first kernel, the whole
    forward pass became one 16 ms 'fusion candidate'. By the heaviest kernel, only memory-bound chains remain."""
    assert analysis.fusion
    assert [c.pattern for c in analysis.fusion if _dense(c.ops)] == []
    patterns = [c.pattern for c in analysis.fusion]
    assert any("log_softmax" in p and "nll_loss_forward" in p for p in patterns), patterns
    assert any("log_softmax_backward_data" in p for p in patterns)
    assert any("layer_norm" in p and "add" in p for p in patterns) and any("gelu" in p for p in patterns)
    # the loss's chains, forward and backward: 10.9 ms a step by a reading of the trace by hand (issue 46)
    loss = sum(c.time_per_step_s for c in analysis.fusion if "nll_loss" in c.pattern)
    assert 0.009 < loss < 0.012


def test_the_idle_share_is_taken_against_the_step_without_the_profiler(analysis):
    """The profiler slowed the window by 32%: its idle share (35.7%) is the profiler's. The device's busy time per
    step (~47.7 ms) against the 48.7 ms real step leaves ~2%."""
    window, basis, _ = idle_share(analysis)
    assert basis == "window" and window == pytest.approx(0.357, abs=0.005)
    real, basis, how = idle_share(analysis, STEP_MS / 1e3)
    busy = (1 - real) * STEP_MS
    assert basis == "step_ms" and 0.0 <= real < 0.05 and "48.70 ms" in how
    b = analysis.breakdown
    assert busy == pytest.approx((b.computing + b.communicating + b.copying + b.waiting_for_data)
                                 * analysis.window_s / analysis.steps * 1e3, rel=1e-9)
    assert idle_share(analysis, 0.040)[0] == 0.0  # a real step shorter than the busy time: clamped, never negative


def test_the_devices_busy_time_is_the_union_of_the_traces_device_events(analysis):
    """An independent count from the raw events: the union of every kernel, copy and memset (what HTA's temporal
    breakdown reports, 140.11 ms, after moving each of the 2,957 events' ends inward to whole microseconds:
    benchmarks/try_hta.py) equals computing + exposed communication + copying over the window, 143.03 ms."""
    import gzip

    events = json.load(gzip.open(TRACE))["traceEvents"]
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    union, (start, end) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            union, start, end = union + end - start, s, e
        else:
            end = max(end, e)
    union = (union + end - start) / 1e6
    b = analysis.breakdown
    assert len(spans) == 2957 and union == pytest.approx(0.14303, abs=1e-5)
    assert (b.computing + b.communicating + b.copying) * analysis.window_s == pytest.approx(union, rel=1e-9)


def test_step3_advises_no_cuda_graphs_for_the_profilers_idle_time(analysis):
    """Step 3's result from the H200 run, its figures recomputed: idle_share is the real step's, the window's is
    kept beside it, and 'act: CUDA graphs' (the device idle between kernels) is no longer advised."""
    d = json.loads((DATA / "03_kernels_result.json").read_text())
    r = kernels.KernelsResult.from_dict(d)
    step_s = r.metric("step_time_median_s")
    assert step_s == pytest.approx(STEP_MS / 1e3, abs=1e-4)
    old = [a.message for a in kernels.advise(r) if a.message.startswith("The device is idle between")]
    assert old, "the run as it was advised CUDA graphs for the profiled window's idle time"
    m = trace_metrics(analysis, r.metric("memory_bandwidth_bytes_per_s"), "measured", step_s=step_s)
    assert m["idle_share"].value < 0.05 and m["profiled_idle_share"].value == pytest.approx(0.357, abs=0.005)
    r.analysis, r.metrics = analysis, {**r.metrics, **m}
    assert [a.message for a in kernels.advise(r) if a.message.startswith("The device is idle between")] == []
    fuse = [a for a in kernels.advise(r) if a.message.startswith("Fuse '")]
    assert fuse and not any(_dense(a.message.split("'")[1].split(" + ")) for a in fuse)


def test_mfu_lab_trace_reads_a_trace_the_user_brings():
    p = in_process("trace", TRACE, "--step-ms", STEP_MS, "--json")
    assert p.returncode == 0, p.stderr
    f = json.loads(p.stdout)
    assert f["idle_share"]["basis"] == "step_ms" and f["idle_share"]["value"] < 0.10
    assert f["fusion"] and all(not _dense(c["ops"]) for c in f["fusion"])
    assert any("log_softmax" in c["ops"] and "nll_loss_forward" in c["ops"] for c in f["fusion"])
    assert f["kind"] == "gpu" and f["steps"] == 3 and f["step_s"] == pytest.approx(0.0487)
    text = in_process("trace", TRACE, "--top", 5)
    assert text.returncode == 0 and "give --step-ms for the real one" in text.stdout
    assert "idle: 35.7% of the profiled step" in text.stdout and text.stdout.count("[matmul]") >= 1
    # the candidates' order is the traffic fusing would save, and each line gives it: the loss chain first
    gib = [float(m) for m in re.findall(r"([\d.]+) GiB/step of traffic to save", text.stdout)]
    assert len(gib) == len(f["fusion"]) and gib == sorted(gib, reverse=True)
    assert gib[0] == pytest.approx(f["fusion"][0]["saved_bytes_per_step"] / 2**30, abs=0.01)
    assert not TRACE.with_suffix("").exists() and TRACE.exists()  # read, never compressed, moved or removed


@pytest.mark.parametrize("args, key", [(["--step-ms", "0"], "--step-ms"), (["--step-ms", "nan"], "--step-ms"),
                                       (["--top", "0"], "--top")])
def test_mfu_lab_trace_refuses_bad_arguments(args, key):
    p = in_process("trace", TRACE, *args)
    assert p.returncode == 2 and f"key '{key}'" in p.stderr


def test_mfu_lab_trace_names_a_file_that_is_no_trace(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text('{"not": "a trace"}')
    for path, says in ((tmp_path / "missing.json", "no such file"), (bad, "no 'traceEvents' list")):
        p = in_process("trace", path)
        assert p.returncode == 2 and "key 'FILE'" in p.stderr and says in p.stderr, p.stderr
