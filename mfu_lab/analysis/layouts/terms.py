"""A layout's counted terms in closed form: collective bytes per optimizer step, pipeline sends and bubble, and
memory per rank. Pure functions of plain numbers, shared by steps 1, 3, 6 and 7; issue 29 holds the placement
model against them.

Bytes follow :mod:`mfu_lab.core.measure.commcount`'s convention, the whole buffer of each collective (nccl-tests'
"size"): an all-gather counts its gathered output, a reduce-scatter its input. Every figure is per rank and per
optimizer step of one forward and backward (no gradient accumulation outside the pipeline's micro-batches).
Each formula was checked by counting on torch 2.13 with gloo at world 2 (tests/test_commcount.py); the memory
formulas are the placement model's (:mod:`mfu_lab.analysis.placement.model`), called here, not repeated.

A layout is duck-typed: any object with ``dp``, ``tp``, ``pp`` and, optionally, ``dp_mode`` ('ddp' | 'fsdp'),
``sp``, ``pp_schedule``, ``pp_microbatches``, ``pp_virtual_stages`` (as :class:`mfu_lab.core.engine.layout.Layout` has).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from mfu_lab.analysis.placement import model as pl
from mfu_lab.analysis.placement.collectives import (  # noqa: F401  (one home each; re-exported with the terms)
    bubble_fraction,
    p2p_sends_per_rank,
    tp_collectives_per_layer,
)
from mfu_lab.core.store.results import Metric


# ------------------------------------------------------------------ data parallel
def ddp_all_reduce_bytes(params: float, grad_bytes: int = 4) -> float:
    """DDP all-reduces every gradient once per step: params * grad_bytes (Li et al. 2020, PyTorch DDP, section 3)."""
    return params * grad_bytes


def fsdp_all_gather_bytes(params: float, param_bytes: int = 4, reshard_after_forward: bool = True,
                          root_params: float = 0, root_reshards: bool = False) -> float:
    """FSDP2 all-gathers each group's parameters before forward and, when it resharded after forward, again before
    backward: 2 x param bytes with ``reshard_after_forward``, 1 x without (FSDP2 ``fully_shard`` docstring;
    FIELD-NOTES, counted).

    ``params``: all parameters, ``param_bytes``: the MixedPrecisionPolicy's param_dtype size. ``root_params``: those
    in the root module's own group (embeddings, final norm, head when each block is its own group). torch 2.13
    keeps the root unsharded after forward unless ``reshard_after_forward`` was passed to the root's
    ``fully_shard`` explicitly (``root_reshards``); releases before ``FSDPState._auto_reshard_after_forward``
    never reshard the root. An unresharded root's parameters are gathered once.
    """
    twice = 2 if reshard_after_forward else 1
    root = root_params if (reshard_after_forward and not root_reshards) else 0
    return ((params - root) * twice + root) * param_bytes


def fsdp_reduce_scatter_bytes(params: float, reduce_bytes: int = 4) -> float:
    """FSDP2 reduce-scatters every gradient once per step, in the reduce dtype: params * reduce_bytes (FSDP2
    ``fully_shard`` docstring; counted). gloo runs it as an all-reduce of the same input (FIELD-NOTES)."""
    return params * reduce_bytes


# ------------------------------------------------------------------ tensor and sequence parallel
def tp_bytes_per_layer(b: int, s: int, h: int, act_bytes: int, sp: bool = False, checkpointing: bool = False,
                       early_stop: bool = True) -> dict[str, float]:
    """TP bytes of one layer per micro-batch by kind: each collective moves the b*s*h activations,
    b*s*h*act_bytes (:func:`tp_collectives_per_layer` gives how many)."""
    return {kind: n * b * s * h * act_bytes for kind, n in tp_collectives_per_layer(sp, checkpointing,
                                                                                    early_stop).items()}


def sp_boundary_bytes(b: int, s: int, h: int, act_bytes: int) -> dict[str, float]:
    """Collectives at the two ends of the sequence-parallel region, per micro-batch, with the residual stream
    sharded on the sequence: entering it (embeddings chunked, no collective forward) all-gathers the gradient
    in backward, leaving it (before the final norm and head) all-gathers the activations forward: 2 all-gathers of
    b*s*h*act_bytes (the plan in tests/fixtures/count_ranks.py; a plan with a vocabulary-parallel embedding or
    head moves these elsewhere)."""
    return {"allgather": 2 * b * s * h * act_bytes}


def sp_norm_grad_all_reduces(norm_tensors: int, norm_params: float, param_bytes: int = 4,
                             uses: int = 3) -> dict[str, float]:
    """SP's LayerNorm weights are replicated while their gradients stay partial; DTensor all-reduces a partial
    gradient each time an optimizer op reads it: AdamW (foreach=False) reads it 3 times (``lerp_`` for the first
    moment, ``addcmul_(grad, grad)`` for the second), so 3 all-reduces per norm tensor per step (counted on torch
    2.13; FIELD-NOTES: "many small all-reduces")."""
    return {"count": uses * norm_tensors, "bytes": uses * norm_params * param_bytes}


# ------------------------------------------------------------------ pipeline
def p2p_sends_of_rank(rank: int, p: int, m: int, v: int = 1) -> int:
    """Sends of one pipeline rank per step: rank r holds stages r, r+p, ..., r+(v-1)p (loop placement); each stage
    but the last sends each of the m micro-batches' activations forward, each but the first their gradients back.
    GPipe and 1F1B (v = 1): m on the first and last rank, 2m between (counted)."""
    stages = [rank + k * p for k in range(v)]
    return sum(m * ((st < p * v - 1) + (st > 0)) for st in stages)


def p2p_send_bytes(micro_batch: int, s: int, h: int, act_bytes: int, tp: int = 1, sp: bool = False) -> float:
    """Bytes of one pipeline send: a micro-batch's b/m*s*h activations (or their gradient), 1/t of them from
    each rank under sequence parallel (the placement model's p2p term); ``micro_batch`` is b/m."""
    return micro_batch * s * h * act_bytes / (tp if sp else 1)


# ------------------------------------------------------------------ memory per rank
def memory_shape(params: float, n_layers: int, n_heads: int, d_model: int, seq_len: int, micro_batch: int,
                 act_bytes: int = 4, checkpointing: bool = False, unfused_attention: bool = False,
                 grad_as_bucket_view: bool = False, checkpoint_policy: str = "full") -> pl.Shape:
    """The placement model's Shape for the memory formulas (its FLOPs unused: 0). ``micro_batch``: one
    data-parallel rank's samples per optimizer step (the job's ``micro_batch``)."""
    return pl.Shape(n_layers, n_heads, d_model, seq_len, micro_batch, float(params), 0.0, act_bytes,
                    unfused_attention=unfused_attention, checkpointing=checkpointing,
                    grad_as_bucket_view=grad_as_bucket_view, checkpoint_policy=checkpoint_policy)


def _placement_layout(layout) -> tuple[pl.Layout, bool]:
    tp, pp = int(getattr(layout, "tp", 1)), int(getattr(layout, "pp", 1))
    dp = int(getattr(layout, "dp", 0) or getattr(layout, "world", tp * pp) // (tp * pp))
    m = int(getattr(layout, "pp_microbatches", 1)) if pp > 1 else 1
    lay = pl.Layout(tp, pp, dp, m, int(getattr(layout, "pp_virtual_stages", 1)) if pp > 1 else 1,
                    fsdp=getattr(layout, "dp_mode", "ddp") == "fsdp",  # no DDP bucket copy, even at dp 1
                    gpipe=pp > 1 and getattr(layout, "pp_schedule", "1f1b") == "gpipe")
    return lay, bool(getattr(layout, "sp", False)) and tp > 1


def memory_per_rank(shape: pl.Shape, layout) -> dict[str, Metric]:
    """Bytes per rank by kind, each ``analytic``: params, grads, optimizer (AdamW's two moments), ddp_buckets
    (DDP's gradient copy), activations (the first stage's micro-batches in flight) and total.

    The placement model's formulas (:func:`mfu_lab.analysis.placement.model.state_bytes`, ``activation_bytes``):
    16 B/param over t*p, and over the dp ranks too under FSDP; activations s*b*h*(8 + 24/t)*bytes/2 per layer
    (Korthikanti et al. 2022), SP's as measured. ``shape.micro_batch`` is a data-parallel rank's batch; under
    pipeline parallel each of its ``pp_microbatches`` micro-batches is micro_batch/m samples.
    """
    lay, sp = _placement_layout(layout)
    s = dataclasses.replace(shape, micro_batch=max(1, shape.micro_batch // lay.m), sequence_parallel=sp)
    state = pl.state_bytes(s, lay)
    acts = pl.activation_bytes(s, lay)
    how = {"params": "float32 weights, 4 B/param", "grads": "float32 gradients, 4 B/param",
           "optimizer": "AdamW's two float32 moments, 8 B/param",
           "ddp_buckets": "DDP's bucket copy of the gradients (0 under FSDP or gradient_as_bucket_view)"}
    split = f"/ (tp {lay.tp} x pp {lay.pp}{f' x fsdp {lay.dp}' if lay.fsdp else ''})"
    if shape.root_params:
        split += (f"; the {shape.root_params:,.0f} parameters outside the blocks whole under TP"
                  + (f", + the untied head's {shape.pp_head_params:,.0f} under PP" if shape.pp_head_params and
                     lay.pp > 1 else ""))
    out = {k: Metric(float(v), "bytes", "analytic", f"{how[k]} {split}") for k, v in state.items()}
    out["activations"] = Metric(float(acts), "bytes", "analytic", "s*b*h*(8 + 24/t)*bytes/2 per layer"
                                f"{' (SP: (8 + 24)/t + the gathered attention input)' if sp else ''}, "
                                f"{'m' if lay.gpipe else 'min(p, m)'} micro-batches in flight on stage one")
    out["total"] = Metric(float(sum(state.values()) + acts), "bytes", "analytic", "the sum of the above")
    return out


def layout_name(dp_mode: str, dp: int, tp: int, pp: int) -> str:
    """Issue 29's names: tp2-fsdp4, pp2-fsdp4, fsdp8, ddp8, tp8."""
    parts = [f"tp{tp}"] * (tp > 1) + [f"pp{pp}"] * (pp > 1) + [f"{dp_mode}{dp}"] * (dp > 1)
    return "-".join(parts) or "single"


def candidate_layouts(shape: pl.Shape, world: int, pp_microbatches: int = 4, sp: bool = False,
                      pp_schedule: str = "1f1b") -> list[dict]:
    """Every dp_mode (ddp, fsdp) x tp x pp of ``world`` ranks with tp | heads and pp | layers, and its memory per
    rank: FSDP only where dp > 1; under PP ``max(pp_microbatches, pp)`` micro-batches, which must divide the
    micro-batch."""
    out = []
    for tp in (t for t in range(1, world + 1) if world % t == 0 and shape.n_heads % t == 0):
        for pp in (p for p in range(1, world // tp + 1) if (world // tp) % p == 0 and shape.n_layers % p == 0):
            dp, m = world // (tp * pp), max(pp_microbatches, pp) if pp > 1 else 1
            if shape.micro_batch % m:
                continue
            for mode in ("ddp", "fsdp") if dp > 1 else ("ddp",):
                lay = SimpleNamespace(dp_mode=mode, dp=dp, tp=tp, pp=pp, sp=sp and tp > 1, pp_microbatches=m,
                                      pp_virtual_stages=1, pp_schedule=pp_schedule)
                mem = memory_per_rank(shape, lay)
                out.append({"name": layout_name(mode, dp, tp, pp), "dp_mode": mode, "dp": dp, "tp": tp, "pp": pp,
                            "sp": lay.sp, "pp_microbatches": m, "memory": mem, "bytes_per_rank": mem["total"].value})
    return out


def layouts_that_fit(shape: pl.Shape, world: int, available_bytes_per_rank: float, pp_microbatches: int = 4,
                     sp: bool = False, pp_schedule: str = "1f1b") -> list[dict]:
    """The :func:`candidate_layouts` whose total per rank is within ``available_bytes_per_rank``, smallest first."""
    fit = [c for c in candidate_layouts(shape, world, pp_microbatches, sp, pp_schedule)
           if c["bytes_per_rank"] <= available_bytes_per_rank]
    return sorted(fit, key=lambda c: (c["bytes_per_rank"], c["name"]))
