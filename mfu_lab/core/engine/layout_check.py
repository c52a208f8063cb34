"""The job's layout against the world it runs in, before anything runs.

:func:`mfu_lab.core.job.schema.validate` refuses what the keys alone show (``sp`` without ``tp``, the reference GPT's
heads and blocks against ``tp`` and ``pp``, the pipeline schedule's rules). What needs more is checked here:

- the world (``nproc_per_node x nnodes``; the caller resolves ``nproc_per_node: 0``, as
  :func:`mfu_lab.workers.launch.world_layout` does): ``tp x pp`` must divide it, and the data-parallel degree is
  what is left, ``world / (tp x pp)`` (issue 28, "The mesh");
- a factory model's (``model: package.module:function``) attention heads and repeated blocks, read from the model
  built on the meta device (shapes only: no memory, no weights, no download): heads (and key/value heads) must
  divide by ``tp``, blocks by ``pp x pp_virtual_stages``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mfu_lab.core.engine.workload import load_user_model
from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.job.rules import captures_cuda_graphs
from mfu_lab.core.job.schema import Job

LAYOUT_SOURCE = "job layout"
HEAD_CONFIG_KEYS = ("num_attention_heads", "num_key_value_heads")  # Hugging Face configs
HEAD_ATTRIBUTES = ("n_heads", "num_heads")  # nanoGPT-style modules, torch's nn.MultiheadAttention


@dataclass(frozen=True)
class ModelShape:
    """What tensor and pipeline parallel split: attention head counts and the repeated blocks, each with where it
    was read (``config.num_attention_heads``, ``model.layers``...). Empty when not found."""

    heads: dict[str, int] = field(default_factory=dict)  # where -> count (query heads, key/value heads...)
    blocks: int | None = None
    blocks_where: str = ""


def read_shape(model: nn.Module) -> ModelShape:
    """Heads and blocks of a model (on any device, the meta device included).

    Heads: ``config.num_attention_heads`` and ``config.num_key_value_heads`` (Hugging Face), else every module's
    ``n_heads`` or ``num_heads`` attribute. Blocks: the repeated block list, the shallowest ``nn.ModuleList`` (or
    ``nn.Sequential``) whose children are all of one class, the longest at that depth; else
    ``config.num_hidden_layers``."""
    heads: dict[str, int] = {}
    config = getattr(model, "config", None)
    for key in HEAD_CONFIG_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            heads[f"config.{key}"] = value
    if not heads:
        for module in model.modules():
            for attr in HEAD_ATTRIBUTES:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    heads.setdefault(f"{type(module).__name__}.{attr}", value)
    best: tuple[int, int, str, int, str] | None = None  # (depth, -length, name, length, class)
    for name, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module):
            kinds = {type(child) for child in module}
            if len(kinds) == 1:
                candidate = (name.count(".") if name else -1, -len(module), name, len(module), kinds.pop().__name__)
                best = min(best, candidate) if best else candidate
    if best:
        return ModelShape(heads, best[3], f"{best[2] or 'the model'}: {best[3]} x {best[4]}")
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0:
        return ModelShape(heads, layers, "config.num_hidden_layers")
    return ModelShape(heads)


def model_shape(job: Job) -> ModelShape:
    """The job's model shape: the reference GPT's from its keys; a factory model's from the model built on the
    meta device. Raises JobError (key ``model``) when the factory cannot build it there."""
    if job.uses_reference_model:
        return ModelShape({"n_heads": job.n_heads}, job.n_layers, f"n_layers: {job.n_layers}")
    try:
        with torch.device("meta"):  # shapes only: a 7B float32 model is 28 GB, more than this machine's RAM
            model = load_user_model(job.model, job.model_kwargs, job.factory_paths, job.trust)
    except Exception as e:  # the user's factory: any failure is theirs to fix, named with the key
        raise JobError(LAYOUT_SOURCE, [JobProblem("model", job.model, "could not be built on the meta device to read "
                                                  f"its attention heads and blocks: {type(e).__name__}: {e}")]) from e
    return read_shape(model)


def _world_words(job: Job, world: int, device_type: str) -> str:
    if job.nproc_per_node:
        return f"{world} ranks (nproc_per_node {job.nproc_per_node} x nnodes {job.nnodes})"
    per = "one per visible GPU" if device_type == "cuda" else "2 on CPU"
    return f"{world} ranks (nproc_per_node 0: {per}; nnodes {job.nnodes})"


def _world_problem(job: Job, world: int, device_type: str) -> JobProblem | None:
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ValueError(f"world must be a whole number >= 1, got {world!r}")
    if world % (job.tp * job.pp) == 0:
        return None
    key, value = ("pp", job.pp) if job.tp == 1 else ("tp", job.tp)
    return JobProblem(key, value, f"tp x pp ({job.tp} x {job.pp} = {job.tp * job.pp}) must divide the world of "
                                  f"{_world_words(job, world, device_type)}: the data-parallel degree is what is "
                                  "left of the world after tp x pp")


def dp_degree(job: Job, world: int, device_type: str = "cpu", source: str = LAYOUT_SOURCE) -> int:
    """The data-parallel degree: ``world / (tp x pp)``. Raises JobError when ``tp x pp`` does not divide the world
    (``device_type`` only words the message: how ``nproc_per_node: 0`` was resolved)."""
    problem = _world_problem(job, world, device_type)
    if problem:
        raise JobError(source, [problem])
    return world // (job.tp * job.pp)


def check_layout(job: Job, world: int, device_type: str, source: str = LAYOUT_SOURCE) -> None:
    """Refuse a layout that cannot run on ``world`` ranks, with every problem at once (JobError from ``source``:
    the job file where the caller knows it).

    The reference GPT's heads and blocks are its keys (validate checked them; a Job built by hand is checked
    again here); a factory model is built on the meta device, and only when ``tp`` or ``pp`` is above 1 (building
    it imports and runs the user's code)."""
    problems = [p for p in [_world_problem(job, world, device_type), graphs_problem(job, device_type)] if p]
    if job.tp > 1 or job.pp > 1:
        try:
            shape = model_shape(job)
        except JobError as e:
            raise JobError(source, problems + e.problems) from e.__cause__
        problems += _model_problems(job, shape)
    if problems:
        raise JobError(source, problems)


def graphs_problem(job: Job, device_type: str) -> JobProblem | None:
    """FSDP2 under CUDA graphs with accumulation: FSDP2 keeps a block's first unsharded gradient as the graph
    outputs it and adds the next micro-batches' to it, but the next replay overwrites that buffer first
    (pytorch/pytorch#169545). The single-process step and the other layouts give each parameter a buffer ahead
    (core.engine.workload.grads_in_place); FSDP2's unsharded parameter exists only between its all-gather and its
    reshard, so none can be given."""
    if not (device_type == "cuda" and job.dp_mode == "fsdp" and job.grad_accum > 1
            and captures_cuda_graphs(job.compile_mode, job.compile_options)):
        return None
    return JobProblem("compile_mode", job.compile_mode, f"captures CUDA graphs, and with dp_mode 'fsdp' and "
                      f"grad_accum {job.grad_accum} the next micro-batch's replay overwrites the gradient FSDP2 "
                      "accumulates into: use compile_mode 'default' or 'max-autotune-no-cudagraphs', or grad_accum 1")


def _model_problems(job: Job, shape: ModelShape) -> list[JobProblem]:
    problems = []
    if job.pp > 1 and job.loss:
        problems.append(JobProblem("pp", job.pp, f"the job's own loss (key 'loss' = {job.loss!r}) reads the whole "
                                   "batch as the data gives it, but a pipeline's last stage holds only its "
                                   "micro-batch's output and targets: use pp: 1 with a loss factory (DDP, FSDP2 and "
                                   "tensor parallel run it)"))
    if job.tp > 1 and not shape.heads:
        problems.append(JobProblem("tp", job.tp, f"needs the attention heads of {job.model}, which could not be "
                                   f"found (looked for config.{', config.'.join(HEAD_CONFIG_KEYS)} and the module "
                                   f"attributes {', '.join(HEAD_ATTRIBUTES)}): tensor parallel gives "
                                   "each rank whole heads; use tp: 1, or give the attention modules n_heads"))
    for where, count in shape.heads.items():
        if job.tp > 1 and count % job.tp:
            problems.append(JobProblem("tp", job.tp, f"must divide the heads of {job.model} ({where} = {count}; "
                                       f"{count} % {job.tp} = {count % job.tp}): tensor parallel gives each rank "
                                       "whole heads"))
    stages = job.pp * job.pp_virtual_stages
    if job.pp > 1 and shape.blocks is None:
        problems.append(JobProblem("pp", job.pp, f"needs the repeated blocks of {job.model}, which could not be "
                                   "found (looked for an nn.ModuleList or nn.Sequential of one block class, and "
                                   "config.num_hidden_layers): the pipeline splits the model between blocks"))
    elif job.pp > 1 and shape.blocks % stages:
        problems.append(JobProblem("pp", job.pp, f"pp x pp_virtual_stages ({job.pp} x {job.pp_virtual_stages} = "
                                   f"{stages}) must divide the blocks of {job.model} ({shape.blocks_where}): each "
                                   "model chunk holds whole blocks"))
    return problems
