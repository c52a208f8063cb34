"""FLOP accounting: analytic formulas, counted FLOPs (one training step's, as every step counts them), MFU and HFU.

Public functions, usable on their own to reproduce a published MFU figure::

    >>> f = transformer_flops_per_token(540.35e9, 118, 48 * 256, 2048)  # PaLM 540B
    >>> round(mfu(f, 238.3e3, 6144 * 275e12), 3)                          # 6144 TPU v4
    0.462

Conventions (``convention=``):
  - ``"palm"`` (default): 6N + 12·L·d·T per token, PaLM (Chowdhery et al. 2022), appendix B.
    N counts parameters that take part in matmuls; the attention term counts the
    full T×T score matrix, as the unfused kernel computes it.
  - ``"causal"``: 6N + 6·L·d·T, the same with the attention term halved because a
    causal kernel can skip the masked upper triangle (as FlashAttention does).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from mfu_lab.core.engine.batches import shape_key
from mfu_lab.core.engine.workload import GPT
from mfu_lab.core.job.factories import source_digest
from mfu_lab.core.store.files import write_json_atomic
from mfu_lab.core.store.results import ResultFormatError, rebuild

CONVENTIONS = ("palm", "causal")


def _attention_flops_per_token(n_layers: int, d_model: int, seq_len: int, convention: str) -> float:
    """Forward+backward FLOPs of QK^T and AV per token: 12·L·d·T (PaLM B), halved when causal."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    full = 12.0 * n_layers * d_model * seq_len
    return full / 2 if convention == "causal" else full


def transformer_flops_per_token(n_params: float, n_layers: int, d_model: int, seq_len: int,
                                convention: str = "palm") -> float:
    """Model FLOPs of one training token (forward + backward) of a decoder-only transformer.

    6N: each matmul parameter does 2 FLOPs per token forward and 4 backward (PaLM, appendix B).
    12·L·d·T: attention scores and weighted sum, forward 4·L·d·T, backward twice that.
    ``n_params`` counts matmul parameters (exclude position-embedding tables; a tied
    input embedding counts once, as the output projection).
    """
    return 6.0 * n_params + _attention_flops_per_token(n_layers, d_model, seq_len, convention)


def hardware_flops_per_token(n_params: float, n_layers: int, d_model: int, seq_len: int,
                             recomputed_params: float = 0.0, recomputed_layers: int = 0,
                             convention: str = "palm", flash_layers: int = 0) -> float:
    """FLOPs the hardware does per token when work is recomputed (for HFU).

    Model FLOPs plus:
    - one extra forward pass of the blocks whose activations are recomputed: 2·N_r + (1/3)·attention term for
      those layers (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
      section 6: full recompute adds one forward, 8N in place of 6N);
    - the score matmul S = QK^T that a flash-style attention kernel recomputes in its backward pass instead of
      storing the T×T scores (Dao et al. 2022, FlashAttention, algorithm 4): one of the six attention matmuls of
      forward + backward, (1/6)·attention term for each of ``flash_layers`` (the memory-efficient, cuDNN and CPU
      fused SDPA kernels recompute the same way).
    With nothing recomputed this equals :func:`transformer_flops_per_token`.
    """
    model = transformer_flops_per_token(n_params, n_layers, d_model, seq_len, convention)
    extra_attention = _attention_flops_per_token(recomputed_layers, d_model, seq_len, convention) / 3
    flash = _attention_flops_per_token(flash_layers, d_model, seq_len, convention) / 6
    return model + 2.0 * recomputed_params + extra_attention + flash


# Fused attention kernels that recompute the scores in their backward pass (flash-style), as FlopCounterMode
# names them: torch's flash, memory-efficient, cuDNN and CPU flash SDPA kernels.
FLASH_STYLE_OPS = ("flash_attention", "efficient_attention", "cudnn_attention")


def flash_style(by_op: dict[str, int]) -> bool:
    """True when the counted step ran a flash-style attention kernel."""
    return any(k in op for op in by_op for k in FLASH_STYLE_OPS)


def flash_recompute_flops(by_op: dict[str, int]) -> float:
    """Counted FLOPs of the score recompute of flash-style kernels: half their counted forward FLOPs
    (the forward is QK^T and PV, of equal size; the backward recomputes QK^T)."""
    return sum(n for op, n in by_op.items() if any(k in op for k in FLASH_STYLE_OPS) and "backward" not in op) / 2


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over peak FLOP/s (a fraction, not %).

    The one MFU function of the workbook: every step calls it. Any unit of work will do in place of a token,
    as long as both arguments use it: a step's FLOPs and steps per second (measured steps / their wall time)
    give the same ratio.
    """
    if peak_flops_per_s <= 0:
        raise ValueError("peak_flops_per_s must be positive")
    return flops_per_token * tokens_per_s / peak_flops_per_s


# ------------------------------------------------------------------ counted FLOPs
def _sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Fused SDPA forward: the two matmuls QK^T and AV (same as torch's GPU formula)."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """Fused SDPA backward as model FLOPs: dV, dP, dQ, dK = 4 matmuls = 2 x forward.

    torch's own GPU formula adds a fifth matmul for the score recompute that
    flash kernels do; that is hardware work, not model work, so for MFU we count
    the four an unfused backward does and the numbers match across kernels.
    """
    return 2 * sdpa_flop_count(query_shape, key_shape, value_shape)


def _attention_mapping() -> dict:
    aten = torch.ops.aten
    forward_ops = ["_scaled_dot_product_flash_attention_for_cpu"]  # absent from torch's registry
    backward_ops = ["_scaled_dot_product_flash_attention_for_cpu_backward",
                    "_scaled_dot_product_flash_attention_backward",
                    "_scaled_dot_product_efficient_attention_backward",
                    "_scaled_dot_product_cudnn_attention_backward"]
    mapping = {}
    for name in forward_ops:
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = _sdpa_forward
    for name in backward_ops:
        if hasattr(aten, name):
            mapping[getattr(aten, name)] = _sdpa_backward
    return mapping


@dataclass
class FlopCount:
    total: int
    by_op: dict[str, int]


def count_flops(fn: Callable[[], object]) -> FlopCount:
    """Run ``fn`` under FlopCounterMode (attention counted as model FLOPs on every backend)."""
    with FlopCounterMode(display=False, custom_mapping=_attention_mapping()) as mode:
        fn()
    counts = mode.get_flop_counts().get("Global", {})
    return FlopCount(mode.get_total_flops(), {str(op): int(n) for op, n in counts.items()})


# ------------------------------------------------------------------ one training step's FLOPs
@dataclass
class FlopReport:
    """FLOPs of one training step (forward + backward), analytic and counted."""

    model_flops_per_step: float
    model_flops_source: str  # analytic (reference model) or counted (user model)
    hardware_flops_per_step: float
    analytic_flops_per_step: float | None
    counted_flops_per_step: float
    counted_hardware_flops_per_step: float
    disagreement: float | None  # |counted - analytic| / analytic
    convention: str
    formula: str
    counted_by_op: dict[str, int]
    matmul_params: int | None
    flash_recompute_flops_per_step: float = 0.0  # in hardware FLOPs: the score recompute of flash-style kernels


def count_step_flops(model: torch.nn.Module, train_step, x, y, cache_dir: Path | None = None,
                     key_extra: str = "") -> FlopReport:
    """Analytic FLOPs (reference model) and FlopCounterMode's count of one forward+backward.

    ``cache_dir`` (a job's output folder): the count is kept there under a digest of everything it depends on
    (:func:`count_key`), so the steps of one job count once and share it; anything that changes the count
    (the model's structure or source file, its attention, the batch's shape, checkpointing, dtype, device, torch)
    changes the digest. ``key_extra``: what else the count depends on that the model does not show, given by a
    caller that has the job (:func:`job_key_extra`: the model spec and its ``model_kwargs``, which a factory may
    turn into work that its repr does not show)."""
    if cache_dir is not None:
        path = Path(cache_dir) / ".flops" / f"{count_key(model, train_step, x, y, key_extra)}.json"
        if path.is_file():
            try:
                return rebuild(FlopReport, json.loads(path.read_text()))
            except (ValueError, ResultFormatError):
                pass  # a damaged cache entry: count again and replace it
        report = count_step_flops(model, train_step, x, y)
        write_json_atomic(path, report)
        return report
    return per_optimizer_step(_count_micro_batch(model, train_step, x, y),
                              max(1, int(getattr(train_step, "grad_accum", 1) or 1)))


def per_optimizer_step(report: FlopReport, k: int) -> FlopReport:
    """One micro-batch's FLOPs as an optimizer step's of ``k`` micro-batches (``grad_accum``): every figure x k
    (each micro-batch runs the same forward and backward; the optimizer's own FLOPs are not model FLOPs)."""
    if k == 1:
        return report
    return dataclasses.replace(
        report, model_flops_per_step=report.model_flops_per_step * k,
        hardware_flops_per_step=report.hardware_flops_per_step * k,
        analytic_flops_per_step=None if report.analytic_flops_per_step is None else report.analytic_flops_per_step * k,
        counted_flops_per_step=report.counted_flops_per_step * k,
        counted_hardware_flops_per_step=report.counted_hardware_flops_per_step * k,
        flash_recompute_flops_per_step=report.flash_recompute_flops_per_step * k,
        formula=f"{report.formula}; x grad_accum ({k} micro-batches per optimizer step)")


def _count_micro_batch(model: torch.nn.Module, train_step, x, y) -> FlopReport:
    """The FLOPs of one micro-batch's forward and backward (``x``, ``y``)."""

    def fwd_bwd():
        train_step.loss(x, y, eager=True).backward()
        model.zero_grad(set_to_none=True)

    ckpt = isinstance(model, GPT) and model.activation_checkpointing
    if ckpt:  # model FLOPs are counted without the recompute, hardware FLOPs with it
        model.activation_checkpointing = False
        counted = count_flops(fwd_bwd)
        model.activation_checkpointing = True
        counted_hw = count_flops(fwd_bwd).total
    else:
        counted = count_flops(fwd_bwd)
        counted_hw = counted.total
    flash = flash_style(counted.by_op)
    recompute_counted = flash_recompute_flops(counted.by_op)  # once per backward, checkpointed or not
    if isinstance(model, GPT):
        tokens = x.numel()
        n = model.matmul_params()
        analytic = transformer_flops_per_token(n, model.n_layers, model.d_model, x.size(1)) * tokens
        layers = model.n_layers if flash else 0
        # selective (core.engine.checkpointing) keeps the linear layers' and fused attention's outputs: it
        # recomputes no linear matmul, and the attention matmuls only when they are unfused (bmm)
        selective = ckpt and model.checkpoint_policy == "selective"
        hardware = hardware_flops_per_token(
            n, model.n_layers, model.d_model, x.size(1),
            recomputed_params=model.recomputed_matmul_params() if ckpt and not selective else 0,
            recomputed_layers=model.n_layers if ckpt and not (selective and flash) else 0, flash_layers=layers) * tokens
        recompute = _attention_flops_per_token(layers, model.d_model, x.size(1), "palm") / 6 * tokens
        return FlopReport(analytic, "analytic", hardware, analytic, counted.total, counted_hw + recompute_counted,
                          abs(counted.total - analytic) / analytic, "palm",
                          "6N + 12*L*d*T per token (PaLM, appendix B); N = matmul parameters", counted.by_op, n,
                          recompute)
    return FlopReport(float(counted.total), "counted", float(counted_hw + recompute_counted), None, counted.total,
                      counted_hw + recompute_counted, None, "counted",
                      "FlopCounterMode over one forward+backward (no formula knows a user model)", counted.by_op, None,
                      recompute_counted)


def job_key_extra(job) -> str:
    """The job's part of a FLOP count's cache key: its model spec and ``model_kwargs`` (sorted, so their order in
    the job file does not matter), its ``loss`` (the count runs it), and the source of the model and loss factories'
    modules (:func:`mfu_lab.core.job.factories.source_digest`: an edited factory is counted again)."""
    digests = [source_digest(spec, job.factory_paths, job.trust) for spec in (job.model, job.loss)]
    return repr((job.model, sorted(job.model_kwargs.items(), key=lambda kv: str(kv[0])), job.loss, digests))


def count_key(model: torch.nn.Module, train_step, x, y, key_extra: str = "") -> str:
    """16 hex digits over what one step's FLOP count depends on: the caller's ``key_extra`` (the job's model spec
    and kwargs), the model's structure (its repr, with every
    layer's sizes), each attention implementation set on it, the source file of the model's class (a user model
    edited between runs), the batch's shapes and dtypes, activation checkpointing, the step's dtype and device,
    and torch's version."""
    h = hashlib.sha256()
    atts = [getattr(a, "__qualname__", None) or repr(a)  # a function's name, never its address
            for a in (getattr(m, "attention", None) for m in model.modules() if hasattr(m, "attention"))]
    try:
        source = Path(inspect.getsourcefile(type(model)) or "").read_bytes()
    except (OSError, TypeError):
        source = b""
    for part in (key_extra, repr(model), "|".join(atts), hashlib.sha256(source).hexdigest(), shape_key(x),
                 shape_key(y), getattr(model, "activation_checkpointing", None),
                 getattr(train_step, "dtype", None), getattr(train_step, "device_type", None), torch.__version__,
                 getattr(train_step, "grad_accum", 1), getattr(train_step, "loss_impl", "eager"),
                 getattr(model, "checkpoint_policy", "full")):
        h.update(repr(part).encode() + b"\0")
    return h.hexdigest()[:16]
