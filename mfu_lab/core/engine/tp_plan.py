"""Tensor-parallel plans: which Linear of a model is sharded how (colwise, rowwise, sequence), and applying one.

The reference GPT (its fused ``qkv`` split into q, k, v Linears, each sharded per head: same FLOPs, same results),
Hugging Face Llama-style models found by their module names, or the job's own ``tp_plan`` (fnmatch patterns on
module names -> colwise | rowwise | sequence). :func:`mfu_lab.core.engine.parallelize.parallelize` applies a plan
second in its fixed order, after the pipeline split; a job's ``fp8_layers`` were converted before it, and the
plan shards those Float8Linears with torchao's float8 styles where they apply (:func:`float8_styles`).
"""

from __future__ import annotations

import fnmatch
from typing import Any

from torch import nn

from mfu_lab.core.engine.layout import Layout
from mfu_lab.core.engine.workload import GPT
from mfu_lab.core.errors import StepError
from mfu_lab.core.job.schema import Job

LLAMA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def blocks_of(model: nn.Module) -> nn.ModuleList | None:
    """The repeated transformer blocks: the ModuleList holding the most parameters (GPT.blocks, model.layers)."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def _styles(sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
            "sequence": SequenceParallel(),
            # a sub-block's input becomes one DTensor before its colwise Linears, so their input gradients add up
            # as one partial sum and are all-reduced once in backward (q, k, v each from_local'd: three times)
            "replicate": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)),
            "replicate_hidden": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                                   desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            # SP: the residual stream stays local (b, s/tp, h) tensors, as RowwiseParallel(Shard(1)) returns them
            "gather": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "gather_local": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=True),
            "split_local": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                              use_local_output=True)}


def gpt_patterns(sp: bool) -> dict[str, str]:
    """The reference GPT: q, k, v and the MLP's up-projection colwise, the two down-projections rowwise; with SP
    the norms are sequence parallel and each sub-block all-gathers its input and reduce-scatters its output."""
    plan = {"*blocks.*.attn.q": "colwise", "*blocks.*.attn.k": "colwise", "*blocks.*.attn.v": "colwise",
            "*blocks.*.attn.proj": "rowwise", "*blocks.*.mlp.0": "colwise", "*blocks.*.mlp.2": "rowwise"}
    if sp:
        return plan | {"*blocks.*.ln1": "sequence", "*blocks.*.ln2": "sequence", "*blocks.*.attn": "gather",
                       "*blocks.*.mlp": "gather"}
    return plan | {"*blocks.*.attn": "replicate", "*blocks.*.mlp": "replicate"}


def llama_patterns(sp: bool) -> dict[str, str]:
    if sp:
        raise StepError("job key 'sp' = true: sequence parallel is built for the reference GPT only; a Llama-style "
                        "model runs tp without sp here (its decoder layers take keyword inputs the plan does not "
                        "prepare yet)")
    plan = {f"*.{n}": ("rowwise" if n in ("o_proj", "down_proj") else "colwise") for n in LLAMA_NAMES}
    return plan | {"*.self_attn": "replicate_hidden", "*.mlp": "replicate"}  # decoder layers pass hidden_states=


def resolve_plan(module: nn.Module, patterns: dict[str, str]) -> dict[str, str]:
    """Module name -> style, each module taking the first pattern (in the plan's order) its name matches."""
    out = {}
    for name, _ in module.named_modules():
        hit = next((style for pat, style in patterns.items() if name and fnmatch.fnmatchcase(name, pat)), None)
        if hit:
            out[name] = hit
    return out


def plan_of(module: nn.Module, model_kind: str, job: Job, layout: Layout) -> dict[str, str]:
    """Module name -> style for ``module`` (the model, or a pipeline stage): the job's ``tp_plan``, else the
    reference GPT's (its qkv split first) or a Llama-style model's; StepError naming the key when none fits."""
    if job.tp_plan:
        if layout.sp:
            raise StepError("job keys 'sp' = true and 'tp_plan': a user's plan cannot say yet where the residual "
                            "stream is split and gathered; run tp without sp")
        patterns = dict(job.tp_plan)
    elif model_kind == "gpt":
        split_qkv(module, job)
        patterns = gpt_patterns(layout.sp)
    elif model_kind == "llama":
        patterns = llama_patterns(layout.sp)
    else:
        raise StepError(f"job key 'tp' = {layout.tp}: the model has no built-in tensor-parallel plan (neither the "
                        f"reference GPT nor Llama-style {', '.join(LLAMA_NAMES)}); give the job a tp_plan")
    plan = resolve_plan(module, patterns)
    if not plan:
        raise StepError(f"job key 'tp_plan': no module name matches any of {sorted(patterns)}")
    bad = sorted({s for s in plan.values() if s not in _styles(layout.sp)})
    if bad:
        raise StepError(f"job key 'tp_plan': unknown style(s) {bad}; expected colwise | rowwise | sequence")
    _check_heads(module, plan, layout.tp)
    return plan


def unaligned_shards(module: nn.Module, plan: dict[str, str], tp: int) -> dict[str, str]:
    """The Linears whose tensor-parallel shard ``torch._scaled_mm`` would refuse (a CUDA check, not a CPU one): a
    colwise shard's out_features / tp or a rowwise shard's in_features / tp not divisible by 16 (``pad_inner_dim``
    pads only the forward's inner size); name -> the sizes, for the FP8 conversion to leave them out."""
    out = {}
    for name, style in plan.items():
        m = module.get_submodule(name)
        if isinstance(m, nn.Linear) and style in ("colwise", "rowwise"):
            key, size = ("out_features", m.out_features) if style == "colwise" else ("in_features", m.in_features)
            if (size // tp) % 16:
                out[name] = f"{style}: {key} {size} / tp {tp} = {size // tp}"
    return out


def apply_tp(module: nn.Module, model_kind: str, job: Job, layout: Layout, tp_mesh, first: bool,
             last: bool) -> tuple[int, int, str]:
    """The plan applied to ``module``; what it did with the job's Float8Linears (:func:`float8_styles`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan = plan_of(module, model_kind, job, layout)
    styles = _styles(layout.sp)
    full = {name: styles[s] for name, s in plan.items()}
    fp8 = float8_styles(module, plan, full, job, layout, tp_mesh.device_type)
    if layout.sp and model_kind == "gpt" and not job.tp_plan:
        if first:
            full["blocks.0"] = styles["split_local"]  # the embeddings' sum enters the residual stream split
        if last:
            full["ln_f"] = styles["gather_local"]  # gathered once before the final norm and the head
    parallelize_module(module, tp_mesh, full, src_data_rank=None)  # every rank built the same weights: no copy
    return fp8


def split_qkv(module: nn.Module, job: Job) -> None:
    """The reference GPT's fused ``qkv`` split into q, k and v Linears (same weights, same FLOPs), as its built-in
    plan shards them per head; a job's own ``tp_plan`` keeps the model as it is. Before the FP8 conversion too
    (core.engine.parallelize.convert_fp8), so that the three are the Float8Linears the plan shards."""
    if job.tp_plan:
        return
    for m in module.modules():
        if hasattr(m, "qkv") and hasattr(m, "split_qkv"):
            m.split_qkv()


def float8_styles(module: nn.Module, plan: dict[str, str], full: dict[str, Any], job: Job, layout: Layout,
                  device_type: str) -> tuple[int, int, str]:
    """Where the plan shards Float8Linears (the job's ``fp8_layers``, converted before the plan): torchtitan's rule.
    The tensorwise recipe takes torchao's float8 styles, which cast before the collectives so that they move FP8
    (a sub-block whose colwise Linears are all Float8Linear gets its input cast once, ``PrepareFloat8ModuleInput``);
    the rowwise recipes keep the plan's own styles, their collectives in high precision, as does gloo under sequence
    parallel (it cannot all-gather float8 tensors: "Invalid scalar type"). (Float8Linears sharded, sub-block
    inputs cast once, why the plan's own styles or '' for torchao's), for :func:`float8_note`."""
    f8 = [name for name in plan if type(module.get_submodule(name)).__name__ == "Float8Linear"]
    if not f8:
        return 0, 0, ""
    if job.fp8_recipe != "tensorwise" or (layout.sp and device_type != "cuda"):
        return len(f8), 0, (f"recipe {job.fp8_recipe}: torchao's float8 styles are tensorwise only"
                            if job.fp8_recipe != "tensorwise" else
                            "gloo cannot all-gather float8 tensors under sequence parallel")
    from torch.distributed.tensor import Replicate, Shard
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    for name in f8:
        if plan[name] == "colwise":
            full[name] = Float8ColwiseParallel()
        elif plan[name] == "rowwise":
            full[name] = Float8RowwiseParallel(output_layouts=Shard(1) if layout.sp else Replicate())
    prepared = 0
    for name, style in plan.items():  # a sub-block's input cast to FP8 once, before its gather, for its colwise
        inner = [n for n, s in plan.items() if n.startswith(name + ".") and s == "colwise"]
        if style not in ("replicate", "replicate_hidden", "gather") or not inner or any(n not in f8 for n in inner):
            continue
        first = inner[0][len(name) + 1:]
        if style == "replicate_hidden":  # a Llama decoder layer passes hidden_states= to its attention
            full[name] = PrepareFloat8ModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                                  desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                  fwd_config_submodule_fqn=first)
        else:
            full[name] = PrepareFloat8ModuleInput(input_layouts=(Shard(1) if style == "gather" else Replicate(),),
                                                  desired_input_layouts=(Replicate(),), fwd_config_submodule_fqn=first)
        prepared += 1
    return len(f8), prepared, ""


def float8_note(parts: list[tuple[int, int, str]]) -> str:
    """One note for a rank's stages (:func:`float8_styles`'s tuples), '' when no Float8Linear was sharded."""
    n, prepared, why = sum(p[0] for p in parts), sum(p[1] for p in parts), next((p[2] for p in parts if p[2]), "")
    if not n:
        return ""
    if why:
        return (f"FP8 under tensor parallel: {n} Float8Linear(s) sharded by the plan's own styles, their collectives "
                f"in high precision ({why})")
    once = f", {prepared} sub-block input(s) cast once" if prepared else ""
    return (f"FP8 under tensor parallel: {n} Float8Linear(s) sharded by torchao's float8 styles (their inputs cast "
            f"before the collectives{once})")


def _check_heads(module: nn.Module, plan: dict[str, str], tp: int) -> None:
    for name, style in plan.items():
        m = module.get_submodule(name)
        if style == "colwise" and isinstance(m, nn.Linear) and m.out_features % tp:
            raise StepError(f"tp = {tp}: module '{name}' has {m.out_features} output features, not divisible by tp")


def model_kind(model: nn.Module) -> str:
    if isinstance(model, GPT):
        return "gpt"
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    return "llama" if set(LLAMA_NAMES) <= leaves else "other"
