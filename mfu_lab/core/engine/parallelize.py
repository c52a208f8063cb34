"""Apply a job's layout to its model, in one fixed order over one named mesh (torchtitan's ``parallelize``):

    fp8_layers (convert_fp8: the whole model, a tied head untied first under PP, the GPT's qkv split under TP)
    -> pipeline split (apart: each rank keeps its stages) -> tensor parallel (+ sequence parallel)
    -> activation checkpointing -> torch.compile (per block) -> FSDP2 (per block, then the root) or DDP

The tensor-parallel plans live in :mod:`mfu_lab.core.engine.tp_plan`. Every choice that changes how the job runs
is said in ``notes``. The training step over the result is :meth:`Parallelized.step`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mfu_lab.core.engine import fp8 as fp8_layers
from mfu_lab.core.engine.batches import input_embedding
from mfu_lab.core.engine.checkpointing import run_block
from mfu_lab.core.engine.layout import Layout
from mfu_lab.core.engine.losses import accumulation_weights, compiled_cross_entropy, cross_entropy
from mfu_lab.core.engine.tp_plan import apply_tp, blocks_of, float8_note, model_kind, plan_of, unaligned_shards
from mfu_lab.core.engine.workload import GPT, compile_kwargs, grads_in_place, logits_of
from mfu_lab.core.errors import StepError
from mfu_lab.core.job.factories import load_factory
from mfu_lab.core.job.rules import captures_cuda_graphs
from mfu_lab.core.job.schema import Job

NOTE_MP = "MixedPrecisionPolicy replaces autocast"
NOTE_UNTIED = "lm_head untied under PP"


# ------------------------------------------------------------------ pipeline split
def tied_head(model: nn.Module) -> nn.Module | None:
    """The model's head when its weight is the input embedding's (the reference GPT ties them), else None."""
    head, wte = getattr(model, "lm_head", None), getattr(model, "wte", None)
    return head if head is not None and wte is not None and head.weight is wte.weight else None


def untie_head(model: nn.Module) -> bool:
    """Give a head tied to the input embedding its own copy of the weight (a tie cannot span pipeline stages).
    The single-process reference of a PP layout is untied the same way: a tied head trains differently."""
    head, wte = tied_head(model), getattr(model, "wte", None)
    if head is None:
        return False
    head.weight = nn.Parameter(wte.weight.detach().clone())
    return True


class GPTStage(nn.Module):
    """Blocks [lo, hi) of a GPT; the first stage also embeds, the last also normalises and projects to logits."""

    def __init__(self, gpt: GPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.activation_checkpointing = gpt.activation_checkpointing
        self.checkpoint_policy = gpt.checkpoint_policy
        if first:
            self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(gpt.blocks[lo:hi])
        if last:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wte"):  # token ids in
            x = self.wte(x) + self.wpe(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            x = run_block(block, x, self.checkpoint_policy) if self.activation_checkpointing and self.training \
                else block(x)
        return self.lm_head(self.ln_f(x)) if hasattr(self, "lm_head") else x


def split_stages(model: nn.Module, layout: Layout, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """This pipeline rank's (stage index, module) pairs: stages pp_rank, pp_rank + pp, ... (the loop order
    ScheduleInterleaved1F1B expects), each an equal run of blocks."""
    if not isinstance(model, GPT):
        raise StepError(f"job key 'pp' = {layout.pp}: the pipeline split is built for the reference GPT only; "
                        f"{type(model).__name__} cannot be split into stages yet (run it with tp or dp_mode fsdp)")
    n, per = layout.stages, len(model.blocks) // layout.stages
    return [(s, GPTStage(model, s * per, (s + 1) * per, s == 0, s == n - 1))
            for s in range(pp_rank, n, layout.pp)]


# ------------------------------------------------------------------ the result
@dataclass
class Parallelized:
    layout: Layout
    mesh: Any  # DeviceMesh ("pp", "dp", "tp")
    modules: list[nn.Module]  # this rank's model (one), or its pipeline stages' modules
    optimizer: torch.optim.Optimizer
    autocast_dtype: str  # the step's autocast dtype: the job's, or float32 under FSDP (the policy casts)
    vocab_size: int
    notes: list[str] = field(default_factory=list)
    stage_indices: list[int] = field(default_factory=list)  # PP: this rank's stages
    schedule: Any = None  # PP: the pipeline schedule
    ddp: nn.Module | None = None  # the DDP wrapper, when the layout is plain DDP
    dp_grad_sync: bool = False  # DDP mode beside TP/PP: gradients all-reduced over "dp" after backward
    loss_fn: Any = None  # the job's own loss of (output, batch) (key 'loss'), else cross-entropy of the logits
    loss_impl: str = "eager"  # the cross-entropy: eager, or compiled (core.engine.losses)
    cuda_graphs: bool = False  # blocks compiled in a CUDA-graph mode (reduce-overhead, max-autotune) on CUDA
    fp8: fp8_layers.Fp8Applied = field(default_factory=fp8_layers.Fp8Applied)  # the job's fp8_layers, or why not

    @property
    def first_stage(self) -> bool:
        return not self.schedule or 0 in self.stage_indices

    @property
    def last_stage(self) -> bool:
        """This rank computes the loss (every rank without PP; the last stage's ranks with it)."""
        return not self.schedule or self.layout.stages - 1 in self.stage_indices

    def autocast(self):
        if self.autocast_dtype == "float32":
            return contextlib.nullcontext()
        device_type = next(self.modules[0].parameters()).device.type
        return torch.autocast(device_type, dtype=getattr(torch, self.autocast_dtype))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """One optimizer step on this rank's batch; the loss where this rank computes it, else None."""
        return self.accumulate([(x, y)])

    def accumulate(self, parts: list[tuple[Any, Any]]) -> torch.Tensor | None:
        """One optimizer step over this rank's micro-batches ``parts`` (``grad_accum`` of them; a pipeline takes
        one: its schedule splits it into pp_microbatches): each forward and backward, its loss weighted by its
        share of the step's useful tokens; DDP (``no_sync``) and FSDP2 (``set_requires_gradient_sync``) reduce
        gradients on the last micro-batch only. The step's loss where this rank computes it, else None."""
        if self.schedule is not None and len(parts) > 1:
            raise StepError(f"job key 'grad_accum' = {len(parts)}: a pipeline (pp > 1) accumulates over its own "
                            "pp_microbatches; set grad_accum to 1 and raise pp_microbatches instead")
        # under CUDA graphs with accumulation, backward adds into buffers of the parameters' own (grads_in_place:
        # the first micro-batch's gradient would otherwise be the graph's output, overwritten by the next replay)
        in_place = self.cuda_graphs and len(parts) > 1
        self.optimizer.zero_grad(set_to_none=not in_place)  # at the start: a step's gradients stay for shard_bytes()
        if in_place:
            for m in self.modules:
                grads_in_place(m)
        loss = None
        weights = accumulation_weights([y for _, y in parts])
        for i, ((x, y), w) in enumerate(zip(parts, weights)):
            last = i == len(parts) - 1
            with self._grad_sync(last), self.autocast():
                if self.schedule is not None:
                    losses: list[torch.Tensor] = []
                    args = (x,) if self.first_stage else ()
                    kw = {"target": y, "losses": losses} if self.last_stage else {}
                    self.schedule.step(*args, **kw)
                    part = torch.stack([v.detach().float() for v in losses]).mean() if self.last_stage else None
                else:
                    model = self.ddp or self.modules[0]
                    part = job_loss(model, self.modules[0], x, y, self.loss_fn, self.vocab_size, self.loss_impl)
                    part = part if len(parts) == 1 else part * w
                if self.schedule is None:
                    part.backward()
            if part is not None:
                loss = part.detach() if loss is None else loss + part.detach()
        if self.layout.sp and not self.layout.fsdp:
            self._reduce_partial_grads()
        if self.dp_grad_sync:
            self._sync_grads()
        self.optimizer.step()
        return loss

    def _grad_sync(self, last: bool):
        """Gradient reduction on (``last``) or off for the next backward: DDP's ``no_sync``, FSDP2's
        ``set_requires_gradient_sync`` (its all-gathers stay, its reduce-scatters wait for the last micro-batch)."""
        if self.ddp is not None:
            return contextlib.nullcontext() if last else self.ddp.no_sync()
        if self.layout.fsdp:
            for m in self.modules:
                m.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _reduce_partial_grads(self) -> None:
        """SP leaves the norms' gradients partial (each rank summed its sequence shard): all-reduce each once, here,
        rather than at every use inside optimizer.step() (three per parameter with AdamW)."""
        from torch.distributed.tensor import Replicate

        for p in self.parameters():
            g = p.grad
            if g is not None and any(pl.is_partial() for pl in getattr(g, "placements", ())):
                p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in g.placements])

    def _sync_grads(self) -> None:
        group, n = self.mesh["dp"].get_group(), self.layout.dp
        for p in self.parameters():
            if p.grad is not None:
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=group)  # gloo has no AVG: sum, then divide
                g.div_(n)

    def parameters(self) -> list[nn.Parameter]:
        seen, out = set(), []
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def shard_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, from its local shards: parameters, gradients, optimizer state."""
        def local(t) -> int:
            t = t.to_local() if hasattr(t, "to_local") else t
            return t.numel() * t.element_size()

        params = self.parameters()
        opt = sum(local(v) for st in self.optimizer.state.values() for v in st.values() if torch.is_tensor(v))
        return {"params": sum(local(p) for p in params),
                "grads": sum(local(p.grad) for p in params if p.grad is not None), "optimizer": opt}


def job_loss(forward: nn.Module, model: nn.Module, x: Any, y: Any, loss_fn: Any, vocab_size: int,
             loss_impl: str = "eager") -> torch.Tensor:
    """The loss of one batch in a layout, as the single-process step has it (core.engine.workload.TrainStep): the
    job's own loss of ``(output, batch)`` when it names one, the batch as the data gave it (a dict's keys go into
    the forward that takes them); else cross-entropy of the logits against the targets, compiled on its own with
    ``loss_impl: compiled`` (the layouts compile per block, so the loss cannot join a block's region)."""
    from mfu_lab.core.engine.batches import call_model, loss_problem, loss_view

    if loss_fn is None:
        logits = logits_of(forward(x))
        if loss_impl == "compiled":
            if vocab_size and logits.size(-1) != vocab_size:
                return cross_entropy(logits, y, vocab_size)  # raises, naming the classes
            return compiled_cross_entropy()(logits, y)
        return cross_entropy(logits, y, vocab_size)
    loss = loss_fn(call_model(forward, x, model), loss_view(x, y, {}))
    why = loss_problem(loss, loss_fn)
    if why:
        raise StepError(why)
    return loss


# ------------------------------------------------------------------ the one place the order is fixed
def parallelize(model: nn.Module, job: Job, layout: Layout, mesh, device: torch.device) -> Parallelized:
    """``model`` (built on ``device`` with the job's seed, the same on every rank) laid out over ``mesh``."""
    notes: list[str] = []
    kind = model_kind(model)
    pp_rank = mesh["pp"].get_local_rank()
    if layout.pp > 1 and untie_head(model):
        notes.append(f"{NOTE_UNTIED}: a head tied to the input embedding cannot span stages; it gets its own "
                     "copy of the weight (the single-process reference is untied the same way)")
    converted = convert_fp8(job, model, layout, device)  # 0. before any split, sharding or wrapper (torchao)
    if converted.text():
        notes.append(f"FP8: {converted.text()}")
    if layout.pp > 1:  # 1. the pipeline split, apart: this rank keeps its stages only
        parts = split_stages(model, layout, pp_rank)
    else:
        parts = [(0, model)]
    last_index = layout.stages - 1
    fp8_tp = []
    for index, module in parts:
        if layout.tp > 1:  # 2. tensor (+ sequence) parallel
            fp8_tp.append(apply_tp(module, kind, job, layout, mesh["tp"], index == 0, index == last_index))
        if job.activation_checkpointing and kind == "llama":  # 3. checkpointing (the GPT checkpoints its blocks)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if job.compile_mode != "off":  # 4. compile, per block (FSDP then wraps compiled blocks)
            kw = compile_kwargs(job.compile_mode, job.compile_backend, job.compile_dynamic, job.compile_options)
            for block in blocks_of(module) or [module]:
                block.compile(**kw)
    if note := float8_note(fp8_tp):  # one line for the rank's stages
        notes.append(note)
    if layout.tp > 1 and layout.sp:
        notes.append("SP: the LayerNorm gradients stay partial after backward; each is all-reduced once before "
                     "optimizer.step() (left to AdamW, each would be reduced at every use)")
    modules = [m for _, m in parts]
    ddp, sync, autocast_dtype = None, False, job.dtype
    cuda_graphs = captures_cuda_graphs(job.compile_mode, job.compile_options) and device.type == "cuda"
    if layout.fsdp:  # 5. FSDP2: per block, then the root
        _apply_fsdp(modules, layout, mesh["dp"], notes)
        autocast_dtype = "float32"
        if layout.param_dtype != job.dtype or job.dtype != "float32":
            notes.append(f"{NOTE_MP}: parameters computed in {layout.param_dtype}, gradients reduced in "
                         f"{layout.reduce_dtype}; the step runs without autocast")
    elif layout.dp > 1 and layout.is_plain_ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  process_group=mesh["dp"].get_group())
    elif layout.dp > 1:
        sync = True
        notes.append(f"DDP beside TP/PP: each gradient is all-reduced over the {layout.dp} data-parallel ranks after "
                     "backward, one call per parameter (no DDP buckets)")
    params = [p for m in modules for p in m.parameters()]
    is_dt = {type(p).__name__ == "DTensor" for p in params}
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(job.adamw_impl, {})
    if len(is_dt) > 1:
        impl = {"foreach": False}
        notes.append("AdamW foreach=False: some parameters are DTensors and others plain tensors (TP leaves the "
                     "embeddings, norms and head whole), and foreach fails on such a mix")
    optimizer = torch.optim.AdamW(list(dict.fromkeys(params)), lr=job.lr, **impl)
    if job.dtype == "float16":
        notes.append("float16 runs without loss scaling in a layout (the single-process reference uses GradScaler)")
    loss_fn = load_factory(job.loss, None, job.factory_paths, job.trust, key="loss") if job.loss else None
    vocab = job.vocab_size or (emb.num_embeddings if (emb := input_embedding(model)[0]) is not None else 0)
    loss_impl = job.loss_impl
    if loss_impl == "chunked":
        loss_impl = "eager"
        notes.append("loss_impl chunked: a layout computes the cross-entropy from the logits (eager); the chunked "
                     "loss runs in the single-process step only")
    par = Parallelized(layout, mesh, modules, optimizer, autocast_dtype, vocab, notes,
                       [i for i, _ in parts], None, ddp, sync, loss_fn, loss_impl, cuda_graphs, converted)
    if layout.pp > 1:
        par.schedule = _schedule(parts, layout, mesh["pp"].get_group(), device, vocab)
    return par


def convert_fp8(job: Job, model: nn.Module, layout: Layout, device: torch.device) -> fp8_layers.Fp8Applied:
    """The job's ``fp8_layers`` converted in place on the whole model (core.engine.fp8), before the pipeline split,
    tensor parallel, FSDP2 or DDP (torchao converts first, and a stage keeps the converted blocks); under tensor
    parallel the reference GPT's qkv is split first, so that q, k and v are the Float8Linears the plan shards, and
    a Linear whose shard ``torch._scaled_mm`` would refuse (tp_plan.unaligned_shards) stays in high precision."""
    unaligned = {}
    if job.fp8_layers and layout.tp > 1:  # the plan's names (its qkv split) and the shards scaled_mm refuses
        unaligned = unaligned_shards(model, plan_of(model, model_kind(model), job, layout), layout.tp)
    done = fp8_layers.apply(job, model, device.type, unaligned)
    if done.note.startswith(fp8_layers.CHUNKED_HEAD):  # a layout's loss is eager: lm_head stays as in one process
        done = dataclasses.replace(done, note=done.note.replace(fp8_layers.CHUNKED_HEAD, (
            "lm_head stays in high precision, as in the job's single-process step (loss_impl chunked), so that the "
            "layout's loss checks against it"), 1))
    return done


def _apply_fsdp(modules: list[nn.Module], layout: Layout, dp_mesh, notes: list[str]) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, layout.param_dtype),
                              reduce_dtype=getattr(torch, layout.reduce_dtype))
    kw = {"mesh": dp_mesh, "reshard_after_forward": layout.reshard_after_forward, "mp_policy": mp}
    for module in modules:
        blocks = list(blocks_of(module) or [])
        for block in blocks:
            fully_shard(block, **kw)
        fully_shard(module, **kw)
        if layout.prefetch and blocks:
            k = layout.prefetch
            for i, block in enumerate(blocks):
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + k])
                block.set_modules_to_backward_prefetch(blocks[max(0, i - k):i][::-1])
    if layout.prefetch:
        notes.append(f"FSDP2 explicit prefetch: {layout.prefetch} block(s) ahead in forward and behind in backward")


def _schedule(parts: list[tuple[int, nn.Module]], layout: Layout, pp_group, device: torch.device, vocab: int):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    stages = [PipelineStage(m, i, layout.stages, device, group=pp_group) for i, m in parts]

    def loss_fn(logits, target):
        return cross_entropy(logits, target, vocab)

    m = layout.pp_microbatches
    if layout.pp_schedule == "interleaved_1f1b":
        return ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn)
    if len(stages) != 1:
        raise StepError(f"job key 'pp_virtual_stages' = {layout.pp_virtual_stages}: only interleaved_1f1b runs "
                        f"several stages per rank, not {layout.pp_schedule}")
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[layout.pp_schedule](stages[0], m, loss_fn=loss_fn)
