"""A job's ``fp8_layers`` trained in FP8 for real: torchao's float8 training on the Linear layers of the named
groups, where the device has FP8 units.

Step 5 chooses the groups (their loss kept, their speed measured on FP8 hardware) and ``tuned.yaml`` carries them
as ``fp8_layers``; every training step the workbook builds for such a job (:func:`apply`, from
``workload.build_train_step``, step 2's data-parallel ranks and ``parallelize.convert_fp8`` in a layout's ranks:
FSDP2, DDP, pipeline stages and tensor parallel, whose plan then shards the Float8Linears with torchao's float8
styles, core.engine.tp_plan) converts those layers before its optimizer, its compile and any wrapper, sharding or
pipeline split, as torchao asks. Where
it cannot, the step trains without FP8 and says why, in the step's own result: a CPU or a GPU below capability 8.9
(no FP8 units: step 5 emulates the numerics there and claims no speed), torchao not installed, a model already
compiled, wrapped for data parallelism or sharded before the conversion (torchao converts before the wrapper), or
no Linear of the groups with both dimensions divisible by 16 (``torch._scaled_mm``'s alignment).
"""

from __future__ import annotations

import dataclasses
import re

import torch
from torch import nn

FP8_CAPABILITY = (8, 9)  # Ada / Hopper and later have FP8 tensor cores

# the reference GPT's Linear layers by name; another model's by its name with block indices as '*'
# (tensor parallel splits the fused qkv into q, k and v Linears first: still the attn_qkv group)
# (the split ones anchored on '.attn.', so that another model's self_attn.q or cross_attn.v keeps its own name)
_GROUPS = (("attn.qkv", "attn_qkv"), (".attn.q", "attn_qkv"), (".attn.k", "attn_qkv"), (".attn.v", "attn_qkv"),
           ("attn.proj", "attn_out"), ("mlp.0", "mlp_up"), ("mlp.2", "mlp_down"), ("lm_head", "lm_head"))


def group_of(name: str) -> str:
    """A linear layer's group: the reference GPT's parts by name, else its name with block indices as '*'."""
    for key, group in _GROUPS:
        if name.endswith(key):
            return group
    return re.sub(r"\.\d+\.", ".*.", name)


CHUNKED_HEAD = ("lm_head stays in high precision: loss_impl chunked hands its weight to F.linear_cross_entropy, "
                "which no Float8Linear runs")


def fp8_units(device_type: str, index: int | None = None) -> str:
    """'' when the device has FP8 matmul units, else why not."""
    if device_type == "cpu":
        return "a CPU has no FP8 matmul units: torch._scaled_mm runs on a CPU, far too slowly to train with"
    if device_type != "cuda":
        return f"device type {device_type} has no FP8 matmul units torchao's float8 training uses"
    cap = torch.cuda.get_device_capability(index)
    if cap < FP8_CAPABILITY and not torch.version.hip:
        return f"CUDA capability {cap[0]}.{cap[1]} has no FP8 tensor cores (8.9 and up do)"
    return ""


@dataclasses.dataclass(frozen=True)
class Fp8Applied:
    """What :func:`apply` did with a job's ``fp8_layers``: ``layers`` the Linear modules now in FP8 (none when
    ``why_not`` says why), in model order."""

    groups: tuple[str, ...] = ()
    layers: tuple[str, ...] = ()
    recipe: str = ""
    why_not: str = ""
    note: str = ""  # a group asked for that stays in high precision, and why

    @property
    def asked(self) -> bool:
        return bool(self.groups)

    def record(self) -> dict:
        """As a step's result stores it (its fields and :meth:`text`), {} when the job asked for no FP8."""
        return dataclasses.asdict(self) | {"text": self.text()} if self.asked else {}

    def text(self) -> str:
        """One sentence for a report ('' when the job asked for no FP8)."""
        if not self.groups:
            return ""
        named = f"fp8_layers [{', '.join(self.groups)}]"
        if self.why_not:
            return f"{named} not applied: {self.why_not}; these figures are the job's without FP8"
        return (f"{named}: {len(self.layers)} Linear layer(s) train in FP8 (torchao float8 training, recipe "
                f"{self.recipe}, converted before the optimizer and the compile){'; ' + self.note if self.note else ''}"
                f"; MFU stays against the job's dtype's peak, not FP8's")


def _unwrapped_problem(model: nn.Module) -> str:
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        return "the model was compiled before the conversion (torchao converts first)"
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return f"the model is wrapped in {type(model).__name__} already (torchao converts before the wrapper)"
    if any(type(p).__name__ == "DTensor" or type(getattr(p, "data", None)).__name__ == "DTensor"
           for p in model.parameters()):
        return "the model's parameters are sharded already (FSDP2 or tensor parallel: torchao converts before)"
    return ""


def apply(job, model: nn.Module, device_type: str, unaligned: dict[str, str] | None = None) -> Fp8Applied:
    """Convert the Linear layers of ``job.fp8_layers`` to torchao float8 training in place (their parameters,
    tied ones included, stay the same objects), or say why not; see the module docstring. ``unaligned``: Linears
    (name -> why) a layout will shard into pieces ``torch._scaled_mm`` does not take; they stay in high precision,
    said in the note."""
    groups = tuple(getattr(job, "fp8_layers", ()) or ())
    if not groups:
        return Fp8Applied()
    recipe = getattr(job, "fp8_recipe", "tensorwise")
    done = tuple(name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear")
    if done:  # a second training step built on the same model (a FLOP count beside the timed step), or step 2's
        # ranks converting before their wrapper: converted once, these layers (whoever converted them)
        return Fp8Applied(groups, done, recipe, "")
    wrapped = _unwrapped_problem(model)
    if not wrapped:  # a wrapper prefixes the names: its own why-not below
        _check_groups(groups, model)
    why = fp8_units(device_type) or wrapped
    if not why:
        try:
            from torchao.float8 import convert_to_float8_training
        except ImportError:
            why = "torchao is not installed (pip install torchao, or the project's [fp8] extra)"
    if why:
        return Fp8Applied(groups, (), recipe, why)
    note, wanted = "", groups
    if "lm_head" in groups and getattr(job, "loss_impl", "") == "chunked":
        wanted = tuple(g for g in groups if g != "lm_head")
        note = CHUNKED_HEAD
    unaligned = {n: why for n, why in (unaligned or {}).items()
                 if is_candidate(n, model.get_submodule(n), wanted)}
    if unaligned:
        kept = (f"{len(unaligned)} Linear(s) stay in high precision, their tensor-parallel shard not divisible by 16 "
                f"(torch._scaled_mm's alignment): {', '.join(f'{n} ({w})' for n, w in unaligned.items())}")
        note = f"{note}; {kept}" if note else kept

    def take(fqn: str, m: nn.Module) -> bool:
        return is_candidate(fqn, m, wanted) and fqn not in unaligned

    chosen = [name for name, m in model.named_modules() if take(name, m)]
    if not chosen:
        return Fp8Applied(groups, (), recipe, "no Linear layer of these groups has both dimensions divisible by 16 "
                                              f"(torch._scaled_mm's alignment){'; ' + note if note else ''}")
    convert_to_float8_training(model, config=float8_config(recipe), module_filter_fn=lambda m, fqn: take(fqn, m))
    return Fp8Applied(groups, tuple(chosen), recipe, "", note)


def _check_groups(groups: tuple[str, ...], model: nn.Module) -> None:
    """Every group names this model's Linear layers (step 5's names), else a JobError naming the key, the unknown
    groups and the model's own: a misspelt group would otherwise train without FP8 on every device."""
    from mfu_lab.core.errors import JobError, JobProblem

    known = list(dict.fromkeys(group_of(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)))
    unknown = [g for g in groups if g not in known]
    if unknown:
        why = f"unknown layer group(s) {', '.join(map(str, unknown))}; this model's groups: {', '.join(known)}"
        raise JobError("the job", [JobProblem("fp8_layers", list(groups), why)])


def float8_config(recipe: str):
    """torchao's ``Float8LinearConfig`` for ``recipe``, padding the inner dimension (``pad_inner_dim``): the
    grad-weight ``_scaled_mm`` has micro_batch x seq as its inner dimension, which odd batches leave unaligned.
    Needs torchao (the caller imports it first and says why when it is missing)."""
    from torchao.float8 import Float8LinearConfig

    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)


def is_candidate(name: str, module: nn.Module, groups) -> bool:
    """An ``nn.Linear`` of one of ``groups`` whose dimensions ``torch._scaled_mm`` takes (both divisible by 16)."""
    return (isinstance(module, nn.Linear) and group_of(name) in groups and module.in_features % 16 == 0
            and module.out_features % 16 == 0)
