"""grad_accum (issue 46): an optimizer step of k micro-batches, defined once: the loss the mean over the step's
useful tokens, one optimizer and scaler step, a step's time, samples, tokens and FLOPs those of k micro-batches."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch

from mfu_lab.core.engine.losses import IGNORE_INDEX, accumulation_weights
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import validate
from mfu_lab.core.measure.flops import count_step_flops
from mfu_lab.core.measure.timed import run_steps


def _pair(job, n, seed=3, pad=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(job.vocab_size, (n, job.seq_len), generator=g)
    y = torch.randint(job.vocab_size, (n, job.seq_len), generator=g)
    if pad:
        y[: n // 2, -pad:] = IGNORE_INDEX  # the first half padded more: unequal useful tokens per micro-batch
    return x, y


def test_weights_are_each_micro_batchs_share_of_the_useful_tokens():
    a = torch.zeros(2, 10, dtype=torch.long)
    b = torch.zeros(2, 10, dtype=torch.long)
    b[:, 5:] = IGNORE_INDEX
    w = accumulation_weights([a, b])
    assert [float(v) for v in w] == pytest.approx([20 / 30, 10 / 30])
    assert accumulation_weights([a]) == [1.0]
    assert accumulation_weights([torch.zeros(3), torch.zeros(3)]) == [0.5, 0.5]  # not token ids: equal shares


def test_two_micro_batches_train_as_one_batch_of_both(tiny_job):
    """The same samples as one batch of 2m or as two micro-batches of m (padding unequal between them): the same
    loss and the same parameters after the optimizer step."""
    whole = dataclasses.replace(tiny_job, micro_batch=8, grad_accum=1)
    split = dataclasses.replace(tiny_job, micro_batch=4, grad_accum=2)
    x, y = _pair(whole, 8, pad=9)
    m1, m2 = build_model(whole).train(), build_model(split).train()
    s1, s2 = build_train_step(whole, m1, "cpu"), build_train_step(split, m2, "cpu")
    assert s2.grad_accum == 2
    l1 = s1(x, y)
    l2 = s2.accumulate([(x[:4], y[:4], {}), (x[4:], y[4:], {})])
    assert float(l2) == pytest.approx(float(l1), rel=1e-5)
    for p1, p2 in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-4, atol=1e-6)
    # one optimizer step, not two: AdamW's step counter
    assert all(int(st["step"]) == 1 for st in s2.optimizer.state.values())


def test_under_cuda_graphs_the_micro_batches_add_into_gradient_buffers_of_their_own(tiny_job):
    """A CUDA-graph compile mode with accumulation (pytorch/pytorch#169545: the first backward's graph output
    kept as .grad is overwritten by the next replay) gets zero gradient buffers before the first micro-batch, which
    backward adds into in place: the same training as without, buffers kept (zeroed) after the step. The CUDA
    failure itself needs a GPU (benchmarks/gpu_check.py's small job, grad_accum 4, reduce-overhead); here the
    mechanics are forced on CPU."""
    job = dataclasses.replace(tiny_job, micro_batch=4, grad_accum=2)
    x, y = _pair(job, 8, pad=9)
    plain, graphs = build_model(job).train(), build_model(job).train()
    s1, s2 = build_train_step(job, plain, "cpu"), build_train_step(job, graphs, "cpu")
    assert not s1.cuda_graphs and not s2.cuda_graphs  # only on a CUDA device in a CUDA-graph mode
    s2.cuda_graphs = True
    seen = []
    for p in graphs.parameters():  # the buffer each parameter trains with, before and during the step
        p.register_hook(lambda g, p=p: seen.append(p.grad is not None))
    parts = [(x[:4], y[:4], {}), (x[4:], y[4:], {})]
    l1, l2 = s1.accumulate(parts), s2.accumulate(parts)
    assert seen and all(seen)  # every backward found a buffer to add into (never grad=None)
    assert float(l2) == pytest.approx(float(l1), rel=1e-6)
    for p1, p2 in zip(plain.parameters(), graphs.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-7)
        assert p1.grad is None and p2.grad is not None and not p2.grad.any()  # zeroed, not set to None
    one = build_train_step(tiny_job, m := build_model(tiny_job).train(), "cpu")
    one.cuda_graphs = True
    xa, ya = _pair(tiny_job, tiny_job.micro_batch)
    loss = one(xa, ya)
    assert all(p.grad is None for p in m.parameters())  # one micro-batch: nothing accumulates, set to None
    assert loss.grad_fn is None and not loss.requires_grad  # a copy of the step's loss, detached


def test_a_timed_step_takes_k_micro_batches_and_counts_their_samples_and_tokens(tiny_job):
    job = dataclasses.replace(tiny_job, grad_accum=3)
    step = build_train_step(job, build_model(job).train(), "cpu")
    loader = build_loader(job, 4, "cpu")  # 4 optimizer steps' worth: 12 micro-batches
    t = run_steps(step, loader, torch.device("cpu"), 1, 3)
    assert len(t.wall_s) == 4 and len(t.loss) == 4
    assert t.samples == [3 * job.micro_batch] * 4
    assert t.tokens == [3 * job.micro_batch * job.seq_len] * 4
    with pytest.raises(StopIteration):  # the loader held exactly the steps' micro-batches
        run_steps(step, build_loader(job, 1, "cpu"), torch.device("cpu"), 0, 2)


def test_flops_are_those_of_k_micro_batches_and_keyed_by_k(tiny_job, tmp_path):
    x, y = _pair(tiny_job, tiny_job.micro_batch)
    one = build_train_step(tiny_job, m := build_model(tiny_job), "cpu")
    r1 = count_step_flops(m, one, x, y, cache_dir=tmp_path)
    four = dataclasses.replace(tiny_job, grad_accum=4)
    r4 = count_step_flops(m, build_train_step(four, m, "cpu"), x, y, cache_dir=tmp_path)  # not r1 from the cache
    assert r4.model_flops_per_step == 4 * r1.model_flops_per_step
    assert r4.hardware_flops_per_step == 4 * r1.hardware_flops_per_step
    assert r4.analytic_flops_per_step == 4 * r1.analytic_flops_per_step
    assert "grad_accum" in r4.formula and len(list((tmp_path / ".flops").glob("*.json"))) == 2


def test_grad_accum_below_one_is_refused_naming_the_key():
    with pytest.raises(JobError) as e:
        validate({"grad_accum": 0}, "job.yaml")
    assert "grad_accum" in str(e.value) and "job.yaml" in str(e.value)


# ------------------------------------------------------------------ step 3's batch race
from mfu_lab.analysis import tuning  # noqa: E402
from mfu_lab.analysis.result_keys import refusal  # noqa: E402
from mfu_lab.steps.kernels import batch_race  # noqa: E402


def test_without_accumulation_a_larger_batch_is_said_to_change_the_optimization(tiny_job):
    r = batch_race.race_batch(tiny_job, torch.device("cpu"), None, 0.01)
    assert r["ran"] is False and "changes the optimization" in r["note"] and "not adopted" in r["note"]
    assert tuning.changes(tiny_job, {"kernels": {"batch_race": r}}) == []


def test_the_splits_hold_the_samples_per_optimizer_step(tiny_job):
    job = dataclasses.replace(tiny_job, micro_batch=4, grad_accum=8)
    assert batch_race.splits(job) == [(4, 8), (8, 4), (16, 2)]
    assert {mb * ga for mb, ga in batch_race.splits(job)} == {32}
    assert batch_race.splits(dataclasses.replace(job, grad_accum=3)) == [(4, 3)]


def test_a_split_that_does_not_fit_is_tried_with_checkpointing_then_left_out(tiny_job):
    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=4)
    seen = []

    def probe(j, device):  # micro_batch 8 fits only with checkpointing; 4 fits as it is
        seen.append((j.micro_batch, j.activation_checkpointing))
        ok = j.micro_batch <= 4 or j.activation_checkpointing
        return ok, f"probed {j.micro_batch}"

    r = batch_race.race_batch(job, torch.device("cuda"), left_s=0.0, step_s=0.1, probe=probe)
    assert (8, True) in seen
    fit = {c["split"]: c for c in r["fit"]}
    assert fit["8x1"]["fits"] and fit["8x1"]["activation_checkpointing"] is True
    assert r["ran"] is False and r["note"].startswith("budget")  # nothing raced beyond the share


def test_a_race_out_of_memory_with_every_split_resident_is_not_raced_and_the_step_goes_on(tiny_job, monkeypatch):
    """Each split is probed alone; the race holds them all at once. An OOM there is the race's note (the step's
    other figures stand), never step 3's failure."""
    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=4)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    monkeypatch.setattr(batch_race, "race_variants", oom)
    r = batch_race.race_batch(job, torch.device("cpu"), None, 0.01, probe=lambda j, d: (True, "fits"))
    assert r["ran"] is False and "resident together" in r["note"] and "2x4, 4x2, 8x1" in r["note"]
    assert "Tried to allocate 2.00 GiB)" in r["note"] and "more" not in r["note"]
    assert tuning.changes(job, {"kernels": {"batch_race": r}}) == []


def test_the_race_holds_the_samples_and_the_loss(tiny_job):
    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=4)
    said = []
    r = batch_race.race_batch(job, torch.device("cpu"), None, 0.01, said.append)
    assert r["ran"] is True and [x["split"] for x in r["rows"]] == ["2x4", "4x2", "8x1"]
    assert all(x["micro_batch"] * x["grad_accum"] == 8 for x in r["rows"])
    finals = [x["final_loss"] for x in r["rows"]]
    assert max(finals) - min(finals) < 1e-3 * abs(finals[0])  # the same samples per step: the same training
    assert any("batch race round" in m for m in said)


def _split_race(mb: int, accum: int, reference: str) -> dict:
    """Step 3's batch race, adopted: micro_batch ``mb`` x grad_accum ``accum`` against the job's ``reference``."""
    return {"ran": True, "adopted": True, "pick": f"{mb}x{accum}", "reference": reference,
            "samples_per_step": mb * accum, "pick_keys": {"micro_batch": mb, "grad_accum": accum},
            "speedup": {"value": 1.4, "low": 1.2, "high": 1.6}}


def _layout(name: str, **changes) -> dict:
    """Step 6's proposal (analysis.layouts.proposal.faster_layout's dict): ``name`` with its key ``changes``."""
    return {"layout": name, "reference": "ddp", "changes": changes, "per_sample_s": 0.01,
            "reference_per_sample_s": 0.02, "speedup": 2.0, "rule": "drawn"}


def test_an_adopted_split_reaches_the_tuned_job_on_its_own_rung(tiny_job):
    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=4)
    race = _split_race(8, 1, "2x4")
    chosen = tuning.changes(job, {"kernels": {"batch_race": race}})
    assert [(c.rung, c.key, c.new) for c in chosen] == [("batch", "micro_batch", 8), ("batch", "grad_accum", 1)]
    stairs = tuning.staircase(job, chosen)
    tuned = stairs[-1][1]
    assert [n for n, _, _ in stairs] == ["original", "batch"]
    assert tuned.micro_batch * tuned.grad_accum == job.micro_batch * job.grad_accum
    assert refusal("batch", "lr", 0.1) is not None  # its row owns the split (and checkpointing) only


def test_step_3s_page_shows_both_races(tiny_job):
    import json

    from mfu_lab.report.tables.kernels import kernels_section

    from .conftest import ROOT

    d = json.loads((ROOT / "tests" / "data" / "h200" / "03_kernels_result.json").read_text())
    d["batch_race"] = batch_race.race_batch(tiny_job, torch.device("cpu"), None, 0.01)  # grad_accum 1: said
    d["optimizer_race"] = {"ran": True, "reference": "foreach", "pick": "fused", "adopted": True,
                           "verdict": "fused is 1.10x [1.04, 1.15] faster, side by side: adopted (adamw_impl)",
                           "method": "3 values of adamw_impl", "final_gap": 0.0,
                           "speedup": {"value": 1.1, "low": 1.04, "high": 1.15},
                           "rows": [{"adamw_impl": "foreach", "steps": 9, "median_step_s": 0.0488,
                                     "final_loss": 10.9},
                                    {"adamw_impl": "fused", "steps": 9, "median_step_s": 0.0444, "final_loss": 10.9}]}
    html = str(kernels_section(d))
    assert "Raced on the job itself" in html and "foreach (the job’s own)" in html
    assert "1.10x [1.04, 1.15]" in html
    assert "changes the optimization" in html  # the batch race's reason at grad_accum 1


def test_step_2s_local_and_slowed_steps_take_an_optimizer_steps_micro_batches(tiny_job):
    """Step 2's no_sync comparison (the same step with gradients kept local) and the tests' slowed configurations
    take grad_accum micro-batches a step, as the synced steps they are compared with do: before, a plain wrapper
    fed one micro-batch a step, so 'no communication' timed a quarter of the work on the GPU job (grad_accum 4)."""
    import contextlib

    from mfu_lab.workers.ddp_rank import kept_local, slowed

    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=2)
    entered = []

    class FakeDDP:  # counts the no_sync contexts: one per optimizer step, around all of its micro-batches
        @contextlib.contextmanager
        def no_sync(self):
            entered.append(1)
            yield

    ts = build_train_step(job, build_model(job).train(), "cpu")
    for step in (kept_local(FakeDDP(), ts), slowed(ts, 0.0), slowed(kept_local(FakeDDP(), ts), 0.0)):
        assert step.grad_accum == 2
        t = run_steps(step, build_loader(job, 2 * 3, "cpu"), torch.device("cpu"), 1, 2)
        assert t.samples == [4, 4, 4]  # 2 micro-batches of 2 per optimizer step
    assert len(entered) == 2 * 3  # the two local wrappers, 3 steps each


def test_a_layouts_step_under_cuda_graphs_adds_into_buffers_too_and_fsdp_is_refused_by_name(tiny_job, world_of_one):
    """The layouts' step (FSDP2, TP, PP, DDP beside them) compiles per block: under a CUDA-graph mode with
    accumulation each parameter gets its gradient buffer before the first micro-batch, as in the single-process
    step, and trains the same. FSDP2 keeps the first micro-batch's unsharded gradient as the graph outputs it, which
    no buffer given ahead can prevent: check_layout refuses that combination before any launch, by its key."""
    from mfu_lab.core.engine.layout import Layout, build_mesh
    from mfu_lab.core.engine.layout_check import check_layout
    from mfu_lab.core.engine.parallelize import parallelize

    job = dataclasses.replace(tiny_job, micro_batch=4, grad_accum=2, tp=1)
    layout = Layout.from_job(job, 1)
    mesh = build_mesh(layout, "cpu")
    cpu = torch.device("cpu")
    plain, graphs = (parallelize(build_model(job).train(), job, layout, mesh, cpu) for _ in range(2))
    assert not graphs.cuda_graphs  # only on a CUDA device in a CUDA-graph mode
    graphs.cuda_graphs = True
    seen = []
    for p in graphs.parameters():
        p.register_hook(lambda g, p=p: seen.append(p.grad is not None))
    x, y = _pair(job, 8, pad=9)
    parts = [(x[:4], y[:4]), (x[4:], y[4:])]
    l1, l2 = plain.accumulate(parts), graphs.accumulate(parts)
    assert seen and all(seen)
    assert float(l2) == pytest.approx(float(l1), rel=1e-6)
    for p1, p2 in zip(plain.parameters(), graphs.parameters()):
        torch.testing.assert_close(p1, p2, rtol=1e-5, atol=1e-7)
    assert all(p.grad is not None for p in graphs.parameters())  # kept for the next step's backward to add into

    fsdp = dataclasses.replace(job, dp_mode="fsdp", compile_mode="reduce-overhead")
    with pytest.raises(JobError) as e:  # before any launch, naming the key, its value and the way out
        check_layout(fsdp, 1, "cuda", source="job.yaml")
    assert [(p.key, p.value) for p in e.value.problems] == [("compile_mode", "reduce-overhead")]
    assert "job.yaml" in str(e.value) and "grad_accum 2" in str(e.value) and "'default'" in str(e.value)
    check_layout(fsdp, 1, "cpu")  # no CUDA graphs on a CPU
    graphs = dataclasses.replace(fsdp, compile_mode="options", compile_options={"triton.cudagraphs": True})
    with pytest.raises(JobError, match="captures CUDA graphs"):  # inductor's own switch: the same capture
        check_layout(graphs, 1, "cuda")
    check_layout(dataclasses.replace(graphs, compile_options={"triton.cudagraphs": False}), 1, "cuda")
    check_layout(dataclasses.replace(fsdp, grad_accum=1), 1, "cuda")  # nothing accumulates
    check_layout(dataclasses.replace(job, compile_mode="reduce-overhead"), 1, "cuda")  # DDP: buffers given ahead


def test_step4_skips_the_cuda_graph_modes_an_fsdp_job_with_accumulation_would_refuse(tiny_job):
    from mfu_lab.steps.compile.step import _skip_reason

    fsdp = dataclasses.replace(tiny_job, dp_mode="fsdp", grad_accum=2)
    why = _skip_reason("reduce-overhead", "cuda", fsdp)
    assert why.startswith("'reduce-overhead' captures CUDA graphs, and with dp_mode 'fsdp' and grad_accum 2")
    assert _skip_reason("max-autotune-no-cudagraphs", "cuda", fsdp) == ""
    assert _skip_reason("reduce-overhead", "cuda", dataclasses.replace(fsdp, grad_accum=1)) == ""


def test_a_split_is_not_adopted_beside_a_layout_that_scales_micro_batch(tiny_job):
    """Step 6's layout (tp 2 at world 2: one data-parallel rank, micro_batch doubled) and step 3's split (raced in
    the job's own DDP layout) each hold the samples per optimizer step alone; applied together the split's
    micro_batch would undo the layout's scale (8 samples where the job trains 16): the split gives way, with why."""
    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=4)
    race = _split_race(8, 1, "2x4")
    layout = _layout("tp2", tp=2, micro_batch=4)
    with mock.patch.object(tuning, "faster_layout", return_value=layout):
        chosen = tuning.changes(job, {"kernels": {"batch_race": race}, "placement": {"layouts": [{}]}})
    by_key = {(c.rung, c.key): c for c in chosen}
    assert by_key["layout", "micro_batch"].adopted and by_key["layout", "tp"].adopted
    for key in ("micro_batch", "grad_accum"):
        assert not by_key["batch", key].adopted
        assert by_key["batch", key].reason.startswith(tuning.BESIDE_LAYOUT) and "micro_batch 4" in \
            by_key["batch", key].reason
    tuned = tuning.tuned_job(job, chosen)
    assert (tuned.micro_batch, tuned.grad_accum, tuned.tp) == (4, 4, 2)


def test_a_layout_step_7_took_back_does_not_bring_the_split_back_untimed(tiny_job):
    """The runner writes tuned.yaml again after step 7 from the stored results: step 7 withdrew the layout (tp and
    micro_batch back to the job's), and the split, left out beside that layout when step 7 ran, stays out (it was
    never timed): the job's own 2 x 4 samples per step, not 2 x 1."""
    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=4)
    race = _split_race(8, 1, "2x4")
    layout = _layout("tp2", tp=2, micro_batch=4)
    back = [{"rung": "layout", "step": "verify", "key": k, "old": v, "new": getattr(job, k), "evidence": "e",
             "label": "measured", "adopted": True, "reason": f"{tuning.WITHDRAWN}: not verified faster"}
            for k, v in layout["changes"].items()]
    with mock.patch.object(tuning, "faster_layout", return_value=layout):
        chosen = tuning.changes(job, {"kernels": {"batch_race": race}, "placement": {"layouts": [{}]},
                                      "verify": {"changes": back}})
    assert not [c for c in chosen if c.adopted]
    assert [c.key for c in chosen if c.rung == "batch"] == ["grad_accum"]  # its micro_batch went with the layout's
    tuned = tuning.tuned_job(job, chosen)
    assert (tuned.micro_batch, tuned.grad_accum, tuned.tp) == (2, 4, 1)


def test_a_split_left_out_beside_a_pipeline_stays_out_when_step_7_takes_the_pipeline_back(tiny_job):
    """Step 6's pp 2 refuses grad_accum > 1, so step 3's 2 x 2 split gives way (the later rung) and step 7 times the
    pipeline alone; when step 7 withdraws it, tuned.yaml written again must not adopt the split it never timed."""
    job = dataclasses.replace(tiny_job, micro_batch=4, grad_accum=1, pp_microbatches=2)
    race = _split_race(2, 2, "4x1")
    layout = _layout("pp2", pp=2)
    results = {"kernels": {"batch_race": race}, "placement": {"layouts": [{}]}}
    with mock.patch.object(tuning, "faster_layout", return_value=layout):
        seen = tuning.changes(job, results)  # what step 7 finds
        back = [{"rung": "layout", "step": "verify", "key": "pp", "old": 2, "new": 1, "evidence": "e",
                 "label": "measured", "adopted": True, "reason": f"{tuning.WITHDRAWN}: not verified faster"}]
        after = tuning.changes(job, results | {"verify": {"changes": back}})  # the runner's rewrite
    assert [(c.key, c.adopted) for c in seen] == [("pp", True), ("micro_batch", False), ("grad_accum", False)]
    assert "grad_accum" in seen[1].reason and seen[1].reason.startswith(tuning.CLASH_REASON)
    assert not [c for c in after if c.adopted]
    assert (tuning.tuned_job(job, after).micro_batch, tuning.tuned_job(job, after).grad_accum) == (4, 1)
