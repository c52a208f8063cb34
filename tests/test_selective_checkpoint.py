"""Selective activation checkpointing (issue 46: "Selective checkpointing ... recompute only what is cheap"):
``checkpoint_policy: selective`` keeps the matmul and fused-attention outputs and recomputes the rest; the training
is the same, the counted recompute drops, the memory formula agrees with what the policy keeps, and step 3's batch
race tries it before the full checkpoint."""

import dataclasses

import pytest
import torch

from mfu_lab.analysis.placement import model as pl
from mfu_lab.core.engine import checkpointing as ck
from mfu_lab.core.engine.workload import GPT
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import Job, load_job, validate
from mfu_lab.core.measure.flops import count_flops, hardware_flops_per_token, transformer_flops_per_token
from mfu_lab.steps.kernels import batch_race

B, T, V, L, H, D = 2, 16, 64, 2, 2, 32


def _gpt(attention="sdpa", ckpt=False, policy="full"):
    torch.manual_seed(0)
    return GPT(L, H, D, V, T, attention, ckpt, policy).train()


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("attention", ["sdpa", "unfused"])
def test_selective_trains_exactly_as_without_a_checkpoint(attention):
    x = torch.randint(V, (B, T))
    plain, grads = _grads(_gpt(attention), x)
    for policy in ("full", "selective"):
        loss, g = _grads(_gpt(attention, True, policy), x)
        assert loss == plain
        for a, b in zip(grads, g):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_selective_recomputes_no_linear_matmul_and_the_count_says_so():
    """FlopCounterMode over forward and backward: the full checkpoint adds one forward of the blocks' matmuls
    (hardware_flops_per_token's formula), the selective one adds none with fused attention, and with unfused
    attention only the attention matmuls (its bmm, recomputed: the scores are what a checkpoint drops)."""
    x = torch.randint(V, (B, T))

    def counted(model):
        return count_flops(lambda: model(x).sum().backward()).total

    n, tokens = _gpt().matmul_params(), B * T
    full = _gpt("sdpa", True, "full")
    assert counted(full) == pytest.approx(
        hardware_flops_per_token(n, L, D, T, full.recomputed_matmul_params(), L) * tokens, rel=0.02)
    assert counted(_gpt("sdpa", True, "selective")) == pytest.approx(
        transformer_flops_per_token(n, L, D, T) * tokens, rel=0.02)
    assert counted(_gpt("unfused", True, "selective")) == pytest.approx(
        hardware_flops_per_token(n, L, D, T, 0, L) * tokens, rel=0.02)


def test_the_memory_formula_holds_what_the_policy_keeps():
    """The outputs the policy marks MUST_SAVE in one forward, counted from the ops' own arguments, are the
    formula's s*b*h*(8/t + 2) elements per layer at t = 1."""
    kept = []
    real = ck._policy

    def spy(ctx, op, *args, **kwargs):
        decision = real(ctx, op, *args, **kwargs)
        if decision == ck.CheckpointPolicy.MUST_SAVE and not ctx.is_recompute:
            if op == torch.ops.aten.addmm.default:
                kept.append(args[1].shape[0] * args[2].shape[1])
            elif op == torch.ops.aten.mm.default:
                kept.append(args[0].shape[0] * args[1].shape[1])
            else:  # fused attention: its output has the query's shape
                kept.append(args[0].numel())
        return decision

    ck_policy, ck._policy = ck._policy, spy
    try:
        _gpt("sdpa", True, "selective")(torch.randint(V, (B, T))).sum().backward()
    finally:
        ck._policy = ck_policy
    shape = pl.Shape(L, H, D, T, B, 0.0, 0.0, 4, checkpointing=True, checkpoint_policy="selective")
    assert sum(kept) / L == pytest.approx(pl.selective_saved_bytes(shape, 1) / 4)


def test_selective_memory_lies_between_none_and_full():
    """GPT-2 124M's shape at micro_batch 16 in bf16: no checkpoint > selective > full, analytic."""
    base = pl.Shape(12, 12, 768, 1024, 16, 124e6, 0.0, 2)
    lay = pl.Layout(1, 1, 1, 1)
    none = pl.activation_bytes(base, lay)
    sel = pl.activation_bytes(dataclasses.replace(base, checkpointing=True, checkpoint_policy="selective"), lay)
    full = pl.activation_bytes(dataclasses.replace(base, checkpointing=True), lay)
    assert none > sel > full


def test_the_job_refuses_a_policy_without_checkpointing_and_names_the_allowed_values(tmp_path):
    bad = tmp_path / "job.yaml"
    bad.write_text("checkpoint_policy: selective\n")
    with pytest.raises(JobError, match="checkpoint_policy.*activation_checkpointing: true") as e:
        load_job(bad)
    assert "job.yaml" in str(e.value)
    with pytest.raises(JobError, match="checkpoint_policy") as e:
        validate({"activation_checkpointing": True, "checkpoint_policy": "some"}, "t.yaml")
    assert "full" in str(e.value) and "selective" in str(e.value)
    job = validate({"activation_checkpointing": True, "checkpoint_policy": "selective"}, "t.yaml")
    assert job.checkpoint_policy == "selective"


@pytest.mark.parametrize("fits_with,expect", [("selective", "selective"), ("full", "full")])
def test_the_batch_race_tries_selective_before_full(tiny_job, fits_with, expect):
    job = dataclasses.replace(tiny_job, micro_batch=2, grad_accum=4)
    seen = []

    def probe(j, device):  # micro_batch 8 fits only with the policy asked (full saves the most memory)
        seen.append((j.micro_batch, j.activation_checkpointing, j.checkpoint_policy))
        ok = j.micro_batch <= 4 or (j.activation_checkpointing and (fits_with == "selective"
                                                                     or j.checkpoint_policy == "full"))
        return ok, f"probed {j.micro_batch}"

    r = batch_race.race_batch(job, torch.device("cuda"), left_s=0.0, step_s=0.1, probe=probe)
    tries = [s for s in seen if s[0] == 8]
    assert tries[:2] == [(8, False, "full"), (8, True, "selective")]
    fit = {c["split"]: c for c in r["fit"]}["8x1"]
    assert fit["fits"] and fit["activation_checkpointing"] is True and fit["checkpoint_policy"] == expect
    assert ("with full activation checkpointing" in fit["how"]) == (expect == "full")


def test_the_steps_hardware_flops_fall_from_full_to_selective(tiny_job, tmp_path):
    """Step 1's FLOP report (count_step_flops, cached per job): the same model FLOPs under every policy, and
    hardware FLOPs, analytic and counted, above the model's with the full checkpoint and at the model's plus the
    fused attention's own score recompute with the selective one; the two policies are counted apart (cache key)."""
    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
    from mfu_lab.core.measure.flops import count_step_flops

    reports = {}
    for policy in ("full", "selective"):
        job = dataclasses.replace(tiny_job, activation_checkpointing=True, checkpoint_policy=policy)
        model = build_model(job).train()
        x, y = next(iter(build_loader(job, 1, "cpu")))
        reports[policy] = count_step_flops(model, build_train_step(job, model, "cpu"), x, y, cache_dir=tmp_path)
    full, sel = reports["full"], reports["selective"]
    assert full.model_flops_per_step == sel.model_flops_per_step
    assert full.hardware_flops_per_step > sel.hardware_flops_per_step
    assert sel.hardware_flops_per_step == pytest.approx(sel.model_flops_per_step + sel.flash_recompute_flops_per_step)
    assert full.counted_hardware_flops_per_step > sel.counted_hardware_flops_per_step
    assert sel.counted_hardware_flops_per_step == pytest.approx(
        sel.counted_flops_per_step + sel.flash_recompute_flops_per_step, rel=0.02)


def test_a_model_factory_is_not_told_to_checkpoint_what_the_workbook_cannot(tmp_path):
    """activation_checkpointing wraps the reference gpt's blocks; with a model factory it would change nothing, so
    the job file refuses it (naming the file and the key), and the OOM advice does not offer it."""
    from mfu_lab.core.process import faults

    bad = tmp_path / "job.yaml"
    bad.write_text("model: mymodels:build\nactivation_checkpointing: true\n")
    with pytest.raises(JobError, match="activation_checkpointing.*reference gpt's blocks only") as e:
        load_job(bad)
    assert "job.yaml" in str(e.value)
    advice = faults.oom_advice(dataclasses.replace(Job(), model="mymodels:build", micro_batch=8))
    assert advice and not any(a.startswith("activation_checkpointing") for a in advice)
    assert any(a.startswith("activation_checkpointing: true with checkpoint_policy: selective")
               for a in faults.oom_advice(Job(micro_batch=8)))
