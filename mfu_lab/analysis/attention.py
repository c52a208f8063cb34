"""Attention implementations: what this device offers, whether each is right, how fast it is.

Every implementation takes q, k, v of shape (batch, heads, seq, head_dim) and
computes causal softmax(QK^T / sqrt(d)) V. Candidates: the explicit unfused
form, SDPA with torch's own choice, SDPA pinned to each backend that
``torch.nn.attention.sdpa_kernel`` knows, and the ``flash_attn`` package. One
that cannot run here is kept in the list as skipped, with the reason.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from mfu_lab.core.measure.timed import Stats, stats

# Relative error allowed against the float32 unfused reference, by the dtype the kernel runs in.
TOLERANCE = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 3e-2}
SDPA_BACKENDS = {"math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION"}


def unfused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(QK^T / sqrt(d)) V with the T x T score matrix materialised, causal mask applied."""
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(mask, float("-inf")).softmax(dim=-1) @ v


def _sdpa(backend: SDPBackend | None) -> Callable:
    def fn(q, k, v):
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return fn


def _flash_attn_fn() -> Callable:  # pragma: no cover - needs the flash_attn package and a GPU
    from flash_attn import flash_attn_func

    def fn(q, k, v):  # flash_attn wants (batch, seq, heads, head_dim)
        return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True).transpose(1, 2)

    return fn


@dataclass
class Impl:
    name: str
    fn: Callable | None
    skipped: str = ""  # why it cannot run here; empty when it can


def candidates(device_type: str, dtype: str) -> list[Impl]:
    """Every implementation to try on this device; unavailable ones carry their reason."""
    out = [Impl("unfused", unfused), Impl("sdpa (torch's choice)", _sdpa(None))]
    for short, attr in SDPA_BACKENDS.items():
        backend = getattr(SDPBackend, attr, None)
        if backend is None:
            out.append(Impl(f"sdpa {short}", None, f"SDPBackend.{attr} does not exist in torch {torch.__version__}"))
        else:
            out.append(Impl(f"sdpa {short}", _sdpa(backend)))
    try:
        import flash_attn  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "flash_attn":
            out.append(Impl("flash_attn package", None, "the flash_attn package is not installed"))
        else:  # installed, but something it needs is missing: say what
            out.append(Impl("flash_attn package", None, f"flash_attn is installed but does not import: {e}"))
    except Exception as e:  # a broken build (undefined symbol, CUDA mismatch): its own words
        out.append(Impl("flash_attn package", None,
                        f"flash_attn is installed but does not import: {type(e).__name__}: {str(e)[:300]}"))
    else:  # pragma: no cover - GPU only
        if device_type != "cuda":
            out.append(Impl("flash_attn package", None, "flash_attn runs on CUDA GPUs only"))
        elif dtype == "float32":
            out.append(Impl("flash_attn package", None, "flash_attn supports float16/bfloat16 only; job is float32"))
        else:
            out.append(Impl("flash_attn package", _flash_attn_fn()))
    return out


@dataclass
class Check:
    ok: bool
    rel_error: float | None  # worst of output and the three input gradients
    tolerance: float
    error: str = ""  # why it could not run (then ok is False and rel_error None)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check(fn: Callable, shape: tuple[int, int, int, int], dtype: str, device: torch.device, seed: int = 0) -> Check:
    """Compare ``fn`` in ``dtype`` with the unfused form in float32: output and dq, dk, dv."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, dout = (torch.randn(shape, generator=g).to(device) for _ in range(4))
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = unfused(*ref_in)
    ref_out.backward(dout)
    tol = TOLERANCE[dtype]
    test_in = [t.to(getattr(torch, dtype)).requires_grad_() for t in (q, k, v)]
    try:
        out = fn(*test_in)
        out.backward(dout.to(out.dtype))
    except Exception as e:  # the backend refused these inputs on this device
        return Check(False, None, tol, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    err = max(_rel(out, ref_out), *(_rel(t.grad, r.grad) for t, r in zip(test_in, ref_in)))
    return Check(err <= tol, err, tol)


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def kernel_signature(fn: Callable, shape: tuple[int, int, int, int], dtype: str, device: torch.device) -> str:
    """The aten operators a forward dispatches to: two implementations with the same signature run the
    same kernels (on CPU, torch's own SDPA choice is the flash kernel), so their timing differences are noise."""
    q = torch.randn(shape, device=device, dtype=getattr(torch, dtype))
    with torch.no_grad(), _OpRecorder() as rec:
        fn(q, q, q)
    fused = [op for op in rec.ops if "attention" in op or "flash" in op]
    return "+".join(dict.fromkeys(fused)) if fused else "+".join(dict.fromkeys(rec.ops))


def time_fwd_bwd(fn: Callable, shape: tuple[int, int, int, int], dtype: str, device: torch.device,
                 warmup: int = 2, reps: int = 10, burst: int = 5) -> Stats:
    """Forward + backward of attention alone, warm-up discarded.

    CPU: ``time.perf_counter`` around each rep (the CPU runs synchronously). CUDA: ``burst`` reps back to back
    between two CUDA events, their mean taken as one sample, ``reps`` samples: a host clock around one
    sub-millisecond kernel would mostly time the launch and the synchronisation, not the kernel.
    """
    q, k, v = (torch.randn(shape, device=device, dtype=getattr(torch, dtype), requires_grad=True) for _ in range(3))
    dout = torch.randn(shape, device=device, dtype=getattr(torch, dtype))

    def once():
        fn(q, k, v).backward(dout)
        q.grad = k.grad = v.grad = None

    if device.type == "cuda":  # pragma: no cover - GPU only
        for _ in range(warmup):
            once()
        times = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(burst):
                once()
            b.record()
            b.synchronize()  # sync point: read the events once the burst has finished
            times.append(a.elapsed_time(b) / 1e3 / burst)
        return stats(times)
    times = []
    for i in range(warmup + reps):
        t0 = time.perf_counter()
        once()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return stats(times)
