"""A job's fp8_layers are trained in FP8 for real where the device has FP8 units (core.engine.fp8): before, the
training loop ignored the key that tuned.yaml adopted, so a tuned job on an H100 ran without the FP8 it named and
step 7 could never time the rung. On a CPU the job trains without FP8 and step 1 says why."""

from __future__ import annotations

import dataclasses
import importlib.util
import warnings

import pytest
import torch
from torch import nn

from mfu_lab.core.engine import fp8, losses
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure import device as dev
from mfu_lab.steps import baseline
from mfu_lab.steps.verify import rungs

from .conftest import TINY

GROUPS = ["mlp_up", "lm_head"]
CPU_WHY = "a CPU has no FP8 matmul units: torch._scaled_mm runs on a CPU, far too slowly to train with"


def _cpu_rowwise_refused() -> str | None:
    """Why this torch's CPU ``_scaled_mm`` refuses rowwise scales, or None: torch 2.11's (the GPU machine's, on a
    CPU) takes per-tensor scales only, 2.13's takes both; a CUDA device takes both in either."""
    a, b = torch.ones(16, 32).to(torch.float8_e4m3fn), torch.ones(16, 32).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        if "per-tensor scaling" not in str(e):  # not the refusal known of torch 2.11: a failure of its own
            raise
        return f"torch {torch.__version__}'s CPU _scaled_mm refuses rowwise scales: {str(e)[:120]}"
    return None


@pytest.fixture
def job(tmp_path):
    return dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), fp8_layers=list(GROUPS))


def linear_classes(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_on_a_cpu_the_job_trains_without_fp8_and_step_1_says_why(job):
    model = build_model(job)
    before = linear_classes(model)
    step = build_train_step(job, model, "cpu")
    assert linear_classes(model) == before and set(before.values()) == {"Linear"}  # nothing converted
    assert step.fp8 == fp8.Fp8Applied(tuple(GROUPS), (), "tensorwise", CPU_WHY)
    r = baseline.run(job, write=False)
    assert {"what": "fp8_layers", "reason": CPU_WHY} in r.skipped
    assert r.fp8["why_not"] == CPU_WHY and not r.fp8["layers"]
    said = [a for a in baseline.advise(r) if a.message.startswith("FP8: ")]
    assert len(said) == 1 and said[0].severity == "look"
    assert said[0].message == (f"FP8: fp8_layers [mlp_up, lm_head] not applied: {CPU_WHY}; these figures are the "
                               "job's without FP8.")
    # a job without fp8_layers: nothing said
    plain = build_train_step(dataclasses.replace(job, fp8_layers=[]), build_model(job), "cpu")
    assert not plain.fp8.asked and plain.fp8.text() == ""


def test_the_layers_converted_are_the_groups_linears_that_scaled_mm_takes(job):
    model = build_model(job)  # tiny GPT: d_model 32, vocab 128, 2 blocks
    chosen = [n for n, m in model.named_modules() if fp8.is_candidate(n, m, GROUPS)]
    assert chosen == ["blocks.0.mlp.0", "blocks.1.mlp.0", "lm_head"]
    odd = build_model(dataclasses.replace(job, d_model=24, n_heads=2))  # 24 is not a multiple of 16
    assert [n for n, m in odd.named_modules() if fp8.is_candidate(n, m, GROUPS)] == []


def test_a_model_compiled_or_wrapped_before_the_conversion_is_said_not_converted(job, monkeypatch):
    monkeypatch.setattr(fp8, "fp8_units", lambda device_type, index=None: "")  # as on a GPU with FP8 units
    compiled = fp8.apply(job, torch.compile(build_model(job)), "cuda")
    assert compiled.why_not == "the model was compiled before the conversion (torchao converts first)"
    wrapped = fp8.apply(job, nn.DataParallel(build_model(job)), "cuda")
    assert wrapped.why_not.startswith("the model is wrapped in DataParallel already")
    assert "not applied" in wrapped.text() and "without FP8" in wrapped.text()


def test_with_fp8_units_and_torchao_the_groups_train_in_float8(job, monkeypatch):
    """torchao's float8 training converts on any device; a CPU runs torch._scaled_mm slowly, enough for a tiny
    job's step. The device check is set as a GPU's with FP8 units would answer it."""
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[fp8]')")
    monkeypatch.setattr(fp8, "fp8_units", lambda device_type, index=None: "")
    model = build_model(job)
    tied = model.lm_head.weight
    step = build_train_step(job, model, "cpu")
    assert step.fp8.why_not == "" and step.fp8.layers == ("blocks.0.mlp.0", "blocks.1.mlp.0", "lm_head")
    classes = linear_classes(model)
    assert {n for n, c in classes.items() if c == "Float8Linear"} == set(step.fp8.layers)
    assert model.lm_head.weight is tied is model.wte.weight  # the tie and the optimizer's parameters kept
    x = torch.randint(0, job.vocab_size, (job.micro_batch, job.seq_len))
    loss = step.loss(x, torch.roll(x, -1, 1))
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].mlp[0].weight.grad is not None
    assert "3 Linear layer(s) train in FP8 (torchao float8 training, recipe tensorwise" in step.fp8.text()
    again = build_train_step(job, model, "cpu")  # another step on the same model (a FLOP count): converted once
    assert again.fp8 == step.fp8 and linear_classes(model) == classes
    wrapped = fp8.apply(job, nn.DataParallel(model), "cpu")  # DDP's ranks convert before the wrapper: said converted
    assert wrapped.why_not == "" and wrapped.layers == tuple(f"module.{n}" for n in step.fp8.layers)


def test_step_7_times_the_fp8_rung_where_the_device_has_fp8_units(job, monkeypatch):
    stairs = [("original", dataclasses.replace(job, fp8_layers=[]), []),
              ("fp8", job, [dataclasses.make_dataclass("C", ["key", "new"])("fp8_layers", list(GROUPS))])]
    cpu = dev.resolve_device("cpu")
    made, _ = rungs.staircase_rungs(stairs, cpu)
    assert made[1].status == "excluded" and made[1].reason.startswith(f"FP8 is emulated on this device ({CPU_WHY})")
    monkeypatch.setattr(rungs, "_fp8_reason", lambda device: "")  # a GPU with FP8 units
    made, _ = rungs.staircase_rungs(stairs, cpu)
    if importlib.util.find_spec("torchao") is None:
        assert made[1].status == "excluded" and made[1].reason.startswith("torchao is not installed")
    else:
        assert made[1].status == "ok"
    monkeypatch.setattr(rungs.importlib.util, "find_spec", lambda name: object())  # as with torchao installed
    made, _ = rungs.staircase_rungs(stairs, cpu)
    assert made[1].status == "ok" and made[1].keys == {"fp8_layers": GROUPS}


def test_with_a_chunked_loss_lm_head_stays_in_high_precision_and_the_step_says_so(job, monkeypatch):
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[fp8]')")
    if why := losses.chunked_available():  # torch 2.11 refuses loss_impl chunked by name (tests/test_loss_impl.py)
        pytest.skip(why)
    monkeypatch.setattr(fp8, "fp8_units", lambda device_type, index=None: "")
    chunked = dataclasses.replace(job, loss_impl="chunked")  # lm_head's weight goes to F.linear_cross_entropy
    model = build_model(chunked)
    step = build_train_step(chunked, model, "cpu")
    assert step.fp8.layers == ("blocks.0.mlp.0", "blocks.1.mlp.0") and type(model.lm_head) is nn.Linear
    assert step.fp8.note.startswith("lm_head stays in high precision: loss_impl chunked")
    assert "2 Linear layer(s) train in FP8" in step.fp8.text() and step.fp8.note in step.fp8.text()


def test_step_7_does_not_time_an_fp8_rung_whose_process_trained_without_fp8(job, tmp_path, monkeypatch):
    """The parent thinks the device has FP8 units; the rung's own process (on this CPU) finds none: the rung is
    excluded with its process's reason, not timed as FP8, and the original rung is timed as ever."""
    monkeypatch.setattr(rungs, "_fp8_reason", lambda device: "")
    monkeypatch.setattr(rungs.importlib.util, "find_spec", lambda name: object())
    run_job = dataclasses.replace(job, verify_rounds=2, verify_steps=1, verify_warmup_steps=0)
    stairs = [("original", dataclasses.replace(run_job, fp8_layers=[]), []),
              ("fp8", run_job, [dataclasses.make_dataclass("C", ["key", "new"])("fp8_layers", list(GROUPS))])]
    made, jobs = rungs.staircase_rungs(stairs, dev.resolve_device("cpu"))
    assert [r.status for r in made] == ["ok", "ok"]
    rungs.measure_rungs(run_job, made, jobs, tmp_path, lambda msg: None)
    assert made[1].status == "excluded"
    assert made[1].reason == (f"its process trained without FP8: {CPU_WHY}; its time would not be FP8's, so the "
                              "rung is not timed")
    assert made[0].status == "ok" and made[0].loss  # the original rung: warmed up and timed


def test_a_withdrawn_fp8_rung_below_the_top_one_makes_the_tuned_file_another_job_than_the_one_timed(job):
    """On FP8 units the rungs above a withdrawn FP8 rung were timed with its layers converted while tuned.yaml no
    longer holds them: step 7 must time the file as written (retime.stale), as for any key one process applies."""
    from mfu_lab.steps.verify import retime

    plain = dataclasses.replace(job, fp8_layers=[])
    compiled = dataclasses.replace(job, compile_mode="default")  # above the FP8 rung: fp8_layers carried
    made = [rungs.Rung("original", {}, "ok"), rungs.Rung("fp8", {"fp8_layers": GROUPS}, "ok"),
            rungs.Rung("compile", {"compile_mode": "default"}, "ok")]
    tuned = dataclasses.replace(plain, compile_mode="default")  # the FP8 rung withdrawn: slower on the GPU
    gone = retime.stale(made, [plain, job, compiled], made[2], tuned)
    assert gone is not None and gone.keys == {"fp8_layers": (GROUPS, [])} and gone.rungs == ["fp8"]
    assert retime.stale(made, [plain, job, compiled], made[2], compiled) is None  # kept: the same job
    made[1].status = "excluded"  # emulated (a CPU): no rung converted, so fp8_layers changed nothing timed
    assert retime.stale(made, [plain, job, compiled], made[2], tuned) is None


def test_a_layouts_ranks_convert_before_fsdp2_and_train_the_same_as_one_process_in_fp8(job, world_of_one,
                                                                                        monkeypatch):
    """FSDP2 over one rank (and the plain one-rank layout, which builds no DDP wrapper), the device check answered
    as on an FP8 GPU: the groups' Linears become Float8Linear before fully_shard, the layout says so in its notes,
    and its losses are the single-process FP8 step's on the same batches. Over several ranks torchao's scales are
    each rank's own: test_the_loss_check_loosens_where_fp8_scales_differ_from_the_references."""
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[fp8]')")
    from mfu_lab.core.engine.layout import Layout, build_mesh
    from mfu_lab.core.engine.parallelize import parallelize

    monkeypatch.setattr(fp8, "fp8_units", lambda device_type, index=None: "")
    torch.manual_seed(0)
    x = torch.randint(0, job.vocab_size, (job.micro_batch, job.seq_len))
    batches = [(x, torch.roll(x, -1, 1))] * 3
    one = build_train_step(job, build_model(job).train(), "cpu")
    reference = [float(one(*b)) for b in batches]
    for mode in ("fsdp", "ddp"):
        lay_job = dataclasses.replace(job, dp_mode=mode)
        layout = Layout.from_job(lay_job, 1)
        model = build_model(lay_job).train()
        par = parallelize(model, lay_job, layout, build_mesh(layout, "cpu"), torch.device("cpu"))
        assert par.fp8.why_not == "" and par.fp8.layers == ("blocks.0.mlp.0", "blocks.1.mlp.0", "lm_head"), mode
        assert {n for n, c in linear_classes(model).items() if c == "Float8Linear"} == set(par.fp8.layers)
        assert any(n.startswith("FP8: fp8_layers [mlp_up, lm_head]: 3 Linear layer(s) train in FP8") for n in par.notes)
        assert [float(par.step(*b)) for b in batches] == pytest.approx(reference, rel=1e-5), mode


def test_a_pipeline_keeps_its_converted_blocks_and_tensor_parallel_converts_q_k_and_v_apart(job):
    from mfu_lab.core.engine import parallelize as pz
    from mfu_lab.core.engine.layout import Layout

    model = build_model(job)
    on_cpu = pz.convert_fp8(job, model, Layout.from_job(dataclasses.replace(job, pp=2), 2), torch.device("cpu"))
    assert on_cpu.why_not == CPU_WHY and "Float8Linear" not in linear_classes(model).values()
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed (pip install -e '.[fp8]'): the conversion before the split not run")
    real_units = fp8.fp8_units
    try:
        fp8.fp8_units = lambda device_type, index=None: ""  # as on a GPU with FP8 units
        pp = Layout.from_job(dataclasses.replace(job, pp=2), 2)
        pz.untie_head(model)
        done = pz.convert_fp8(job, model, pp, torch.device("cpu"))
        tp_job = dataclasses.replace(job, tp=2, fp8_layers=["attn_qkv"])
        tp = pz.convert_fp8(tp_job, build_model(tp_job), Layout.from_job(tp_job, 2), torch.device("cpu"))
    finally:
        fp8.fp8_units = real_units
    stages = [m for _, m in pz.split_stages(model, pp, 0)] + [m for _, m in pz.split_stages(model, pp, 1)]
    in_stages = {f"{i}.{n}" for i, s in enumerate(stages) for n, m in s.named_modules() if type(m).__name__ ==
                 "Float8Linear"}
    assert len(done.layers) == 3 and in_stages == {"0.blocks.0.mlp.0", "1.blocks.0.mlp.0", "1.lm_head"}
    # tensor parallel: the fused qkv split first, so that the plan shards q, k and v as Float8Linears of attn_qkv
    assert tp.why_not == "" and tp.layers == tuple(f"blocks.{b}.attn.{x}" for b in (0, 1) for x in "qkv")
    assert {fp8.group_of(n) for n in tp.layers} == {"attn_qkv"}


def test_under_tensor_parallel_a_shard_scaled_mm_refuses_stays_in_high_precision_and_is_named(job):
    """CUDA's torch._scaled_mm wants every size of a shard divisible by 16 (a CPU does not check, so only this rule
    keeps a GPU from crashing): at tp 4 the tiny GPT's q, k, v (out 32 / 4) and attn.proj (in 32 / 4) shards are 8
    wide and stay in high precision, the MLP's (128 / 4 = 32) convert; the reference converts the same."""
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[fp8]')")
    from mfu_lab.core.engine import parallelize as pz
    from mfu_lab.core.engine.layout import Layout
    from mfu_lab.core.engine.tp_plan import plan_of, unaligned_shards
    from mfu_lab.workers import layout_rank as lr

    tp_job = dataclasses.replace(job, tp=4, fp8_layers=["attn_qkv", "attn_out", "mlp_up", "mlp_down"])
    layout = Layout.from_job(tp_job, 4)
    model = build_model(tp_job)
    plan = plan_of(model, "gpt", tp_job, layout)  # splits the GPT's qkv, as the layout does
    assert unaligned_shards(model, plan, 4)["blocks.0.attn.q"] == "colwise: out_features 32 / tp 4 = 8"
    assert unaligned_shards(model, plan, 4)["blocks.1.attn.proj"] == "rowwise: in_features 32 / tp 4 = 8"
    assert unaligned_shards(model, plan, 2) == {}  # 32 / 2 = 16
    real_units = fp8.fp8_units
    try:
        fp8.fp8_units = lambda device_type, index=None: ""  # as on a GPU with FP8 units
        done = pz.convert_fp8(tp_job, build_model(tp_job), layout, torch.device("cpu"))
        x = torch.randint(0, job.vocab_size, (job.micro_batch, job.seq_len))
        _, converted = lr.reference_losses(tp_job, layout, [(x, torch.roll(x, -1, 1))], torch.device("cpu"))
    finally:
        fp8.fp8_units = real_units
    assert done.layers == tuple(f"blocks.{b}.mlp.{i}" for b in (0, 1) for i in (0, 2)) and converted
    assert done.note.startswith("8 Linear(s) stay in high precision, their tensor-parallel shard not divisible by "
                                "16 (torch._scaled_mm's alignment): ")
    assert "blocks.0.attn.q (colwise: out_features 32 / tp 4 = 8)" in done.note
    assert "8 Linear(s) stay in high precision" in done.text()


def test_the_split_qkv_names_are_attn_qkv_only_in_the_reference_gpt_and_a_ranks_stages_say_fp8_once():
    from mfu_lab.core.engine.tp_plan import float8_note

    assert fp8.group_of("blocks.3.attn.v") == "attn_qkv" and fp8.group_of("blocks.0.attn.qkv") == "attn_qkv"
    assert fp8.group_of("layers.0.self_attn.q") == "layers.*.self_attn.q"  # another model's names stay its own
    assert fp8.group_of("layers.3.cross_attn.v") == "layers.*.cross_attn.v"
    assert float8_note([(0, 0, "")]) == ""
    assert float8_note([(6, 2, ""), (6, 2, "")]) == ("FP8 under tensor parallel: 12 Float8Linear(s) sharded by "
                                                     "torchao's float8 styles (their inputs cast before the "
                                                     "collectives, 4 sub-block input(s) cast once)")
    assert float8_note([(3, 0, "recipe rowwise: x"), (3, 0, "recipe rowwise: x")]).endswith(
        "6 Float8Linear(s) sharded by the plan's own styles, their collectives in high precision (recipe rowwise: x)")


def test_tensor_parallel_trains_its_fp8_layers_sharded_and_checks_the_loss_against_one_process(tmp_path):
    """Two gloo ranks (tests/fixtures/tp_fp8_ranks.py), the device check answered as on an FP8 GPU: every group's
    Linears are Float8Linears holding DTensor shards (lm_head stays whole: the plan leaves it replicated); the
    tensorwise recipe takes torchao's float8 styles, except under sequence parallel on gloo (it cannot all-gather
    float8 tensors), and the rowwise recipe the plan's own styles, as torchtitan does. The losses match the
    single-process reference (q, k, v split alike) at bf16's tolerance, the one the loss check then uses."""
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[fp8]')")
    import json
    import os
    import subprocess
    import sys

    from .conftest import ROOT

    cases = ["0:tensorwise", "1:tensorwise", "0:rowwise", "0:tensorwise:llama"]
    if why := _cpu_rowwise_refused():  # the rowwise case runs where this CPU's _scaled_mm takes its scales
        cases.remove("0:rowwise")
        warnings.warn(f"the rowwise case is left out: {why}", stacklevel=1)
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        f"--log-dir={tmp_path / 'logs'}", str(ROOT / "tests" / "fixtures" / "tp_fp8_ranks.py"),
                        str(tmp_path), ",".join(cases)],
                       cwd=ROOT, timeout=300, capture_output=True, text=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    llama = json.loads((tmp_path / "0_tensorwise_llama.json").read_text())  # 2 layers x 7 Linears + lm_head
    assert llama["why_not"] == "" and len(llama["layers"]) == 15 and llama["reference_converted"] is True
    assert ("FP8 under tensor parallel: 14 Float8Linear(s) sharded by torchao's float8 styles (their inputs cast "
            "before the collectives, 4 sub-block input(s) cast once)") in llama["notes"]  # attention: by keyword
    assert llama["losses"] == pytest.approx(llama["reference"], rel=5e-3)
    for case in [c for c in cases if not c.endswith("llama")]:
        got = json.loads((tmp_path / f"{case.replace(':', '_')}.json").read_text())
        assert got["why_not"] == "" and len(got["layers"]) == 13 and got["reference_converted"] is True, case
        weights = got["float8_weights"]
        assert weights.pop("lm_head") == "Parameter" and set(weights.values()) == {"DTensor"} and len(weights) == 12
        styles = [n for n in got["notes"] if n.startswith("FP8 under tensor parallel: 12 Float8Linear(s) sharded")]
        assert len(styles) == 1, got["notes"]
        if case == "0:tensorwise":
            assert "by torchao's float8 styles" in styles[0] and "4 sub-block input(s) cast once" in styles[0]
        else:
            assert "by the plan's own styles" in styles[0]
            assert ("gloo cannot all-gather float8 tensors" if case == "1:tensorwise" else "recipe rowwise") in \
                styles[0]
        assert got["losses"] == pytest.approx(got["reference"], rel=5e-3), case
        # the scales' amax all-reduces are counted apart from TP's sums, which stay as without FP8 (test_commcount:
        # 4 per layer x 2 layers, tiny.yaml's b*s*h bytes each; under SP the norms' gradients, 8 of them)
        c = got["collectives"]
        assert c["allreduce"]["count"] == 8 and c["allreduce_max"]["count"] > 0, (case, c)
        if case == "0:tensorwise":
            assert c["allreduce"]["bytes"] == 8 * 4 * 32 * 32 * 4 and c["allreduce_max"]["bytes"] == \
                8 * c["allreduce_max"]["count"], c  # one float64 amax each
        if case.endswith("tensorwise"):  # one scale per tensor, its largest magnitude over every shard: the same
            assert got["losses"][0] == pytest.approx(got["reference"][0], rel=1e-6), case  # forward, first step


def test_the_loss_check_loosens_where_fp8_scales_differ_from_the_references():
    """torchao's tensorwise scale is a tensor's largest magnitude over what a rank or a pipeline micro-batch holds:
    2 gloo ranks in float32 measured 6.5e-5 relative against the one-process reference (4.9e-8 without FP8), above
    float32's 1e-5. Such a layout, or one whose reference trained otherwise, is checked at bf16's tolerance, said."""
    from mfu_lab.core.engine.layout import Layout
    from mfu_lab.workers import layout_rank as lr

    job = load_job(TINY)
    ddp2, one = Layout.from_job(job, 2), Layout.from_job(job, 1)
    for layout, converted, ref_fp8, loosened in ((ddp2, True, True, True), (one, True, True, False),
                                                  (one, True, False, True), (ddp2, False, False, False),
                                                  (one, False, True, True)):
        check, notes = {"tolerance": lr.TOLERANCE["float32"], "reference": "single process, global batch",
                        "reference_fp8": ref_fp8}, []
        lr.fp8_tolerance(check, layout, converted, notes)
        assert check["tolerance"] == (lr.TOLERANCE["bfloat16"] if loosened else lr.TOLERANCE["float32"])
        assert bool(notes) == loosened and all(n.startswith("FP8 in the loss check: ") for n in notes)
    notes = []  # tensor parallel: torchao's float8 styles and the rowwise recipes round otherwise than one process
    lr.fp8_tolerance({"tolerance": 1e-5, "reference": "single process, global batch", "reference_fp8": True},
                     Layout.from_job(dataclasses.replace(job, tp=2), 2), True, notes)
    assert notes == ["FP8 in the loss check: under tensor parallel, FP8 does not round exactly as in one process, so "
                     "the losses are compared at tolerance 0.005"]
    notes = []
    lr.fp8_tolerance({"tolerance": 1e-5, "reference": "layout TP2", "reference_fp8": False}, one, True, notes)
    assert "the reference (layout TP2) trained without FP8" in notes[0] and notes[0].endswith("tolerance 0.005")


def test_step_7_in_a_layout_does_not_time_an_fp8_rung_whose_ranks_trained_without_fp8(job, tmp_path, monkeypatch):
    from mfu_lab.steps.verify import layout as vl
    from mfu_lab.workers.layout_launch import LayoutRun

    def runs(job_, device_type, work, items, progress=None, steps=None):
        return [LayoutRun({"name": "FSDP2", "dp": 2}, 2, "gloo", 1, "ok", step_times_s=[[0.1, 0.1], [0.1, 0.1]],
                          losses=[4.0, 3.9], fp8={"why_not": TP_WHY} if it["overrides"].get("fp8_layers") else {})
                for it in items]

    TP_WHY = "torchao is not installed (pip install torchao, or the project's [fp8] extra)"
    monkeypatch.setattr(vl, "run_layouts", runs)
    plain = dataclasses.replace(job, fp8_layers=[])
    made = [rungs.Rung("original", {}, "ok"), rungs.Rung("fp8", {"fp8_layers": GROUPS}, "ok")]
    vl.measure_in_layout(plain, made, [plain, job], tmp_path, lambda m: None, dev.resolve_device("cpu"), 2)
    assert made[0].status == "ok" and made[0].wall_s
    assert made[1].status == "excluded" and not made[1].wall_s
    assert made[1].reason == (f"its ranks trained without FP8 (FSDP2: {TP_WHY}); its time would not be FP8's, so "
                              "the rung is not timed")


def test_step_5s_page_lists_an_emulated_policy_as_no_recommendation():
    from mfu_lab.report.found import _recommendations

    d = {"choice": {"text": "Train mlp_up in FP8"}, "precision": {"choice": {"text": "Train in bfloat16"}},
         "path": "emulated", "advice": []}
    assert [r["message"] for r in _recommendations("fp8", d)[0]] == ["Train in bfloat16"]
    assert [r["message"] for r in _recommendations("fp8", d | {"path": "fp8 hardware"})[0]] == [
        "Train mlp_up in FP8", "Train in bfloat16"]


def test_a_group_the_model_does_not_have_is_an_error_naming_the_key_and_the_models_groups(job):
    from mfu_lab.core.errors import JobError

    bad = dataclasses.replace(job, fp8_layers=["mlp_up", "mlp_sideways"])
    with pytest.raises(JobError) as e:
        build_train_step(bad, build_model(bad), "cpu")  # on any device: a CPU would otherwise just say 'no FP8 units'
    said = str(e.value)
    assert "'fp8_layers'" in said and "unknown layer group(s) mlp_sideways" in said
    assert "this model's groups: attn_qkv, attn_out, mlp_up, mlp_down, lm_head" in said


def test_step_6s_node_layouts_run_without_fp8_and_say_why(tmp_path, monkeypatch):
    """Their terms and the TP link they calibrate are in the job's dtype; FP8 under TP adds the scales' all-reduces
    (a reviewer counted 44 all-reduces a step against 8 at tp 2), which would skew the link's fit."""
    from mfu_lab.core.job.schema import load_job as load
    from mfu_lab.core.measure import device as dev
    from mfu_lab.steps.placement import layouts as pl_layouts
    from mfu_lab.steps.placement.step import job_shape
    from mfu_lab.workers.layout_launch import LayoutRun

    seen = []

    def runs(job_, device_type, work, items, progress=None, steps=None, check_steps=None):
        seen.append(job_)
        return [LayoutRun({"name": "DDP2", "dp": 2}, 2, "gloo", 1, "refused", reason="not here") for _ in items]

    monkeypatch.setattr(pl_layouts, "run_layouts", runs)
    job = load(TINY, {"out_dir": str(tmp_path), "nproc_per_node": 2, "fp8_layers": GROUPS})
    shape, _ = job_shape(job, dev.resolve_device("cpu"))
    lines: list[str] = []
    entries, _ = pl_layouts.measure_layouts(job, "cpu", tmp_path / "work", shape, 0.01, lines.append)
    assert seen and seen[0].fp8_layers == [] and entries
    said = "fp8_layers left out of the node layouts: their terms and the link they calibrate are the job's dtype's"
    assert any(said in line for line in lines) and all(any(said in n for n in e["notes"]) for e in entries)
    plain: list[str] = []
    pl_layouts.measure_layouts(dataclasses.replace(job, fp8_layers=[]), "cpu", tmp_path / "w2", shape, 0.01,
                               plain.append)
    assert not any("fp8_layers" in line for line in plain)


def test_the_collective_counter_counts_a_float8_tensors_bytes_not_its_wrappers():
    pytest.importorskip("torchao", reason="torchao is not installed (pip install -e '.[fp8]')")
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    from mfu_lab.core.measure.commcount import _nbytes

    t = hp_tensor_to_float8_dynamic(torch.randn(4, 16, dtype=torch.bfloat16), torch.float8_e4m3fn, LinearMMConfig())
    assert t.element_size() == 2 and _nbytes(t) == 64  # a bf16 wrapper around 64 float8 bytes
    assert _nbytes([torch.zeros(8), nn.Parameter(torch.zeros(2, 2))]) == 8 * 4 + 4 * 4
