"""The workload: a model and a training step (the data is :mod:`mfu_lab.core.engine.data`'s, re-exported here).

The reference model is a small decoder-only GPT (nanoGPT's layout: pre-norm
blocks, GELU MLP of width 4d, tied input/output embedding) whose attention can
switch between an explicit unfused softmax(QK^T)V and fused SDPA. A user's own
model comes from ``package.module:function`` in the job file: the function
returns an ``nn.Module`` mapping token ids (batch, seq) to logits, or a Hugging
Face causal LM whose output has ``.logits``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mfu_lab.core.engine import fp8 as fp8_layers
from mfu_lab.core.engine.batches import (
    FORWARD_KEYS,
    README_SECTION,
    call_model,
    describe,
    forward_params,
    input_embedding,
    loss_problem,
    loss_view,
    vocab_problem,
)
from mfu_lab.core.engine.checkpointing import run_block
from mfu_lab.core.engine.data import (  # noqa: F401  (re-exported: the steps import the data from here too)
    IGNORE,
    PAD_ID,
    Collate,
    PackedTokens,
    SyntheticTokens,
    VarLenTokens,
    bucket_lengths,
    build_dataset,
    build_loader,
)
from mfu_lab.core.engine.fp8 import Fp8Applied
from mfu_lab.core.engine.losses import (
    accumulation_weights,
    chunked_cross_entropy,
    chunked_problem,
    compiled_cross_entropy,
    cross_entropy,
    head_set_aside,
)
from mfu_lab.core.errors import JobError, JobProblem, StepError
from mfu_lab.core.job.compile_options import options_problem
from mfu_lab.core.job.factories import load_factory
from mfu_lab.core.job.rules import captures_cuda_graphs
from mfu_lab.core.job.schema import Job


# ------------------------------------------------------------------ reference GPT
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str):
        super().__init__()
        self.n_heads, self.attention = n_heads, attention
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def split_qkv(self) -> None:
        """Replace the fused ``qkv`` by ``q``, ``k`` and ``v`` Linears holding the same weights, so tensor parallel
        shards each one per head (core.engine.parallelize). Same FLOPs, same results; forward then works on the heads
        its Linears hold (all of them, or this rank's share)."""
        d = self.proj.in_features
        w, b = self.qkv.weight.detach(), self.qkv.bias.detach()
        for i, name in enumerate("qkv"):
            lin = nn.Linear(d, d, device=w.device, dtype=w.dtype)
            with torch.no_grad():
                lin.weight.copy_(w[i * d:(i + 1) * d])
                lin.bias.copy_(b[i * d:(i + 1) * d])
            setattr(self, name, lin)
        del self.qkv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        hs = self.proj.in_features // self.n_heads  # head size
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(d, dim=2)
        else:  # split for tensor parallel: each Linear may hold this rank's heads only
            q, k, v = self.q(x), self.k(x), self.v(x)
        b, t = q.shape[:2]
        q, k, v = (z.view(b, t, -1, hs).transpose(1, 2) for z in (q, k, v))  # (B, nh, T, hs)
        if callable(self.attention):  # an implementation from mfu_lab.analysis.attention (step 2 swaps them)
            y = self.attention(q, k, v)
        elif self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # unfused: the T x T score matrix is written to memory and read back
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            y = scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, attention)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``forward(idx) -> logits`` of shape (batch, seq, vocab)."""

    def __init__(self, n_layers: int, n_heads: int, d_model: int, vocab_size: int, seq_len: int,
                 attention: str = "sdpa", activation_checkpointing: bool = False, checkpoint_policy: str = "full"):
        super().__init__()
        self.n_layers, self.d_model, self.seq_len = n_layers, d_model, seq_len
        self.activation_checkpointing = activation_checkpointing
        self.checkpoint_policy = checkpoint_policy  # core.engine.checkpointing: full | selective
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, attention) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        """GPT-2's initialisation: N(0, 0.02) weights, zero biases (keeps first losses near ln(vocab))."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def set_attention(self, attention) -> None:
        """'sdpa', 'unfused', or a callable (q, k, v) -> causal attention output."""
        for block in self.blocks:
            block.attn.attention = attention

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            if self.activation_checkpointing and self.training:
                x = run_block(block, x, self.checkpoint_policy)
            else:
                x = block(x)
        return self.lm_head(self.ln_f(x))

    def matmul_params(self) -> int:
        """Parameters that multiply activations: every Linear weight (the tied head once)."""
        seen, n = set(), 0
        for m in self.modules():
            if isinstance(m, nn.Linear) and id(m.weight) not in seen:
                seen.add(id(m.weight))
                n += m.weight.numel()
        return n

    def recomputed_matmul_params(self) -> int:
        """Matmul parameters whose forward activation checkpointing runs again in backward.

        torch's non-reentrant checkpoint stops recomputing once every tensor the
        backward needs is back ("early stop"), so each block's last matmul, the MLP
        down-projection, whose output no backward needs, is not recomputed.
        """
        return sum(m.weight.numel() for b in self.blocks for m in b.modules()
                   if isinstance(m, nn.Linear) and m is not b.mlp[-1])


# ------------------------------------------------------------------ user models
def load_user_model(spec: str, kwargs: dict, factory_paths: list = (), trust: list = ()) -> nn.Module:
    """Import ``package.module:function`` and call it with ``kwargs``; it must return an nn.Module.

    The module must lie beside the job file (the current folder for a job without one), in a folder of
    ``factory_paths`` or in an installed package named in ``trust``, and never in mfu_lab or the standard library
    (:mod:`mfu_lab.core.job.factories`); it is imported from there only. A job loaded from a file holds that file's
    folder in ``factory_paths`` when its factory lies there.
    """
    func = load_factory(spec, None, list(factory_paths), list(trust))
    model = func(**kwargs)
    if not isinstance(model, nn.Module):
        raise StepError(f"job key 'model' = {spec!r}: {spec.split(':')[1]}() returned {type(model).__name__}, "
                        "expected a torch.nn.Module mapping token ids (batch, seq) to logits")
    return model


def logits_of(output) -> torch.Tensor:
    """Logits from a model's output: a tensor, or an object with ``.logits`` (Hugging Face)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise StepError(f"the model returned {type(output).__name__}; expected logits (batch, seq, vocab) "
                    "or an object with a .logits tensor")


def build_model(job: Job) -> nn.Module:
    torch.manual_seed(job.seed)
    if job.uses_reference_model:
        return GPT(job.n_layers, job.n_heads, job.d_model, job.vocab_size, job.seq_len,
                   job.attention, job.activation_checkpointing, job.checkpoint_policy)
    model = load_user_model(job.model, job.model_kwargs, job.factory_paths, job.trust)
    if not any(p.requires_grad for p in model.parameters()):  # else torch's bare "empty parameter list"
        frozen = " (all of them frozen: requires_grad=False)" if any(True for _ in model.parameters()) else ""
        raise StepError(f"model: {job.model} returned a {type(model).__name__} with no parameters to train{frozen}; "
                        "a training step needs at least one, so the factory must return the model to train")
    return model


# ------------------------------------------------------------------ training step
@dataclass
class TrainStep:
    """One optimiser step: forward, loss, backward (``grad_accum`` micro-batches: :meth:`accumulate`), AdamW update
    (autocast for bf16/fp16).

    The loss: the job's ``loss`` function of ``(output, batch)`` when it names one; else the output's ``.loss`` when
    the batch brings ``labels`` and the model's forward takes them (Hugging Face: the model shifts them); else
    cross-entropy of the logits against the targets. Before the first step, the largest token id of the batch is
    held against the model's input embedding (:func:`mfu_lab.core.engine.batches.vocab_problem`).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer
    device_type: str
    dtype: str
    vocab_size: int  # 0: the model's input embedding rows
    compiled: nn.Module | None = None  # torch.compile(model) when the job compiles; shares model's parameters
    loss_fn: Any = None  # the job's own loss of (output, batch), or None
    data: str = "synthetic"  # the job's data key, named in the vocabulary check's message
    reference: bool = True  # the reference GPT (its vocabulary is a job key)
    loss_impl: str = "eager"  # core.engine.losses: eager | compiled | chunked
    grad_accum: int = 1  # micro-batches per optimizer step (core.measure.timed feeds them; accumulate() steps once)
    region: Any = None  # loss_impl compiled under compile_mode: torch.compile of the forward and the loss together
    cuda_graphs: bool = False  # compiled in a CUDA-graph mode (reduce-overhead, max-autotune) on a CUDA device
    fp8: Fp8Applied = dataclasses.field(default_factory=Fp8Applied)  # the job's fp8_layers: converted, or why not

    def __post_init__(self):
        self.scaler = torch.amp.GradScaler(self.device_type, enabled=self.dtype == "float16")
        params, anything = forward_params(self.model)
        self.takes = {k for k in FORWARD_KEYS if k in params or (anything and k == "attention_mask")}
        if not self.vocab_size:
            emb, _ = input_embedding(self.model)
            self.vocab_size = emb.num_embeddings if emb is not None else 0
        self.vocab_checked = False

    def autocast(self):
        if self.dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=getattr(torch, self.dtype))

    def loss(self, x: Any, y: Any, eager: bool = False, **kw: torch.Tensor) -> torch.Tensor:
        """The step's loss; ``eager`` runs the uncompiled model and the eager loss formula (FLOP counting traces
        eager operators). ``kw``: the batch's keyword tensors (``labels``, ``attention_mask``); those the forward
        takes go into it. ``x`` and ``y`` may be a batch that is not token ids (core.engine.batches: any other
        batch), which the job's loss reads. ``loss_impl`` (core.engine.losses) says how the default loss runs."""
        ids = isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex())
        if not self.vocab_checked and ids and x.device.type != "meta":
            why = vocab_problem(self.model, x, self.vocab_size, self.data, self.reference)
            if why:
                raise StepError(why)
            self.vocab_checked = True
        if not eager and self.region is not None:  # loss_impl compiled: the forward and the loss, one region
            return self.region(x, y, kw)
        forward = self.model if eager or self.compiled is None else self.compiled
        return self._forward_loss(forward, x, y, kw, "eager" if eager else self.loss_impl)

    def _forward_loss(self, forward: Any, x: Any, y: Any, kw: dict, impl: str) -> torch.Tensor:
        ids = isinstance(x, torch.Tensor) and not (x.is_floating_point() or x.is_complex())
        fkw = {k: v for k, v in kw.items() if k in self.takes}
        chunked = impl == "chunked" and self.loss_fn is None and "labels" not in fkw and ids
        with self.autocast():
            if chunked:
                with head_set_aside(self.model) as head:
                    hidden = logits_of(forward(x, **fkw))
                    return chunked_cross_entropy(hidden, head, y)
            out = call_model(forward, x, self.model) if isinstance(x, Mapping) else forward(x, **fkw)
        if self.loss_fn is not None:
            loss = self.loss_fn(out, loss_view(x, y, kw))
            why = loss_problem(loss, self.loss_fn)  # a vector or None: named here, not by autograd
            if why:
                raise StepError(why)
            return loss
        own = getattr(out, "loss", None) if "labels" in fkw or isinstance(x, Mapping) else None
        if isinstance(own, torch.Tensor):
            return own.float()
        if not (ids and isinstance(y, torch.Tensor) and y.shape == x.shape and x.dim() == 2):
            got = describe(loss_view(x, y, kw))
            raise StepError(f"the batch is {got}: not token ids with aligned targets, and the job names no loss. Set "
                            "key 'loss' to package.module:function taking (output, batch), which receives the batch "
                            f"as your data gives it ({README_SECTION})")
        logits = logits_of(out)
        if logits.shape[:2] != x.shape or (self.vocab_size and logits.size(-1) != self.vocab_size):
            raise StepError(f"the model's logits have shape {tuple(logits.shape)}; expected "
                            f"({x.size(0)}, {x.size(1)}, vocab_size={self.vocab_size}). "
                            "Set vocab_size in the job to the model's vocabulary (0: its input embedding's)")
        if impl == "compiled" and self.region is None:  # compile_mode off: the loss alone compiled
            return compiled_cross_entropy()(logits, y)
        return cross_entropy(logits, y)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, **kw: torch.Tensor) -> torch.Tensor:
        return self.accumulate([(x, y, kw)])

    def accumulate(self, parts: list[tuple[Any, Any, dict]]) -> torch.Tensor:
        """One optimizer step over ``parts``, its micro-batches ``(x, y, kwargs)`` (``grad_accum`` of them): each
        forward and backward, its loss weighted by its share of the step's useful tokens (core.engine.losses:
        the step's loss is the mean over them all); a DDP model skips its all-reduce on all but the last
        (``no_sync``); the scaler and the optimizer step once. Returns the step's loss."""
        weights = accumulation_weights([y for _, y, _ in parts])
        total, last = None, len(parts) - 1
        in_place = self.cuda_graphs and last > 0
        if in_place:
            grads_in_place(self.model)
        for i, ((x, y, kw), w) in enumerate(zip(parts, weights)):
            local = i < last and hasattr(self.model, "no_sync")
            with self.model.no_sync() if local else contextlib.nullcontext():
                loss = self.loss(x, y, **kw)
                part = loss if last == 0 else loss * w
                self.scaler.scale(part).backward()
            # a copy: under CUDA graphs the loss is the graph's output buffer, which the next step's replay
            # overwrites (a scalar, so the copy costs one tiny kernel)
            total = part.detach().clone() if total is None else total + part.detach()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=not in_place)
        return total


def grads_in_place(model: nn.Module) -> None:
    """Give every trainable parameter a gradient buffer of its own (zeros) before the first micro-batch, so
    that backward adds into it in place. Under a CUDA-graph compile mode with accumulation, a first backward into
    ``grad=None`` keeps the backward graph's output buffer itself as ``p.grad``, and the next micro-batch's replay
    overwrites it ("accessing tensor output of CUDAGraphs that has been overwritten": pytorch/pytorch#169545,
    open; #184003 only words the error). The optimizer then zeroes with ``set_to_none=False``."""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


DYNAMIC = {"auto": None, "static": False, "dynamic": True}


def compile_kwargs(mode: str, backend: str, dynamic: str, options: dict[str, Any]) -> dict[str, Any]:
    """torch.compile keyword arguments for a mode ('options' compiles with the job's compile_options, checked
    again here against the allowed inductor options, :mod:`mfu_lab.core.job.compile_options`: a Job built without
    validation never hands torch a setting that names a program, such as ``cpp.cxx``)."""
    kw: dict[str, Any] = {"backend": backend, "dynamic": DYNAMIC[dynamic]}
    if mode == "options":
        why = options_problem(options) if isinstance(options, dict) else "must be a mapping of names to values"
        if why:
            raise JobError("job (torch.compile options)", [JobProblem("compile_options", options, why)])
        kw["options"] = dict(options)
    elif mode != "default":
        kw["mode"] = mode
    return kw


def eager(job: Job) -> Job:
    """The job without torch.compile: for experiments that compare or instrument the eager model."""
    return dataclasses.replace(job, compile_mode="off")


def build_train_step(job: Job, model: nn.Module, device_type: str, fp8: bool = True) -> TrainStep:
    """The job's training step: its dtype (autocast), float32 matmul precision, ``fp8_layers`` and compile mode.

    ``fp8_layers`` (core.engine.fp8): the named groups' Linear layers go to torchao float8 training in place,
    before the optimizer and the compile, where the device has FP8 units; else the step trains without FP8 and
    ``step.fp8`` says why. ``fp8=False``: step 5, which trains its own FP8 arms against the job without them.

    ``matmul_precision`` is process-wide in torch (``torch.set_float32_matmul_precision``): the process
    that builds the step trains with it. A job with ``compile_mode`` other than ``off`` runs its forward
    through ``torch.compile(model, ...)``, or its forward and loss as one compiled region with ``loss_impl:
    compiled`` (core.engine.losses); the first steps compile (the warm-up steps absorb that).
    """
    torch.set_float32_matmul_precision(job.matmul_precision)
    converted = fp8_layers.apply(job, model, device_type) if fp8 else Fp8Applied()
    impl = {"foreach": {"foreach": True}, "fused": {"fused": True}}.get(job.adamw_impl, {})
    opt = torch.optim.AdamW(model.parameters(), lr=job.lr, **impl)
    compiled = None
    kw = (compile_kwargs(job.compile_mode, job.compile_backend, job.compile_dynamic, job.compile_options)
          if job.compile_mode != "off" else None)
    if kw is not None and job.loss_impl != "compiled":
        compiled = torch.compile(model, **kw)
    if job.loss_impl == "chunked" and (why := chunked_problem(model)):
        raise StepError(why)
    loss_fn = load_factory(job.loss, None, job.factory_paths, job.trust, key="loss") if job.loss else None
    step = TrainStep(model, opt, device_type, job.dtype, job.vocab_size, compiled, loss_fn, job.data,
                     job.uses_reference_model, job.loss_impl, grad_accum=job.grad_accum,
                     cuda_graphs=kw is not None and device_type == "cuda"
                     and captures_cuda_graphs(job.compile_mode, job.compile_options), fp8=converted)
    if kw is not None and job.loss_impl == "compiled":  # one region: the forward, the loss and their casts
        step.region = torch.compile(functools.partial(_region_body, step), **kw)
    return step


def _region_body(step: TrainStep, x: Any, y: Any, kw: dict) -> torch.Tensor:
    """What ``loss_impl: compiled`` compiles under ``compile_mode``: the eager model's forward and the loss."""
    return step._forward_loss(step.model, x, y, kw, "eager")
