"""Step 7 on one GPU: how much of the device each rung's process may hold while every rung stays resident.

The rungs run in processes of their own, all warm at once, taking turns (rungs.py). On CUDA each process's caching
allocator is bounded (``torch.cuda.set_per_process_memory_fraction``), so that one rung fails on its own bound, not
on the others' leftovers. An equal share (1 / the rungs) fails a rung that needs more than the others: GPT-2 124M
at micro_batch 16 peaked at 17.2 GB on the first H200 run, so a tuned 64 x 1 split needs about four times the
activations, and four equal shares of an H100's 80 GB hold none of it.

Each rung's need is estimated (analytic, an upper bound): step 1's measured peak x the rung's micro_batch over the
job's (activations grow with the micro-batch; the parameters, gradients and optimizer state in that peak do not,
so it overestimates a larger split). When the needs fit the device together, each rung gets its need's share of
what is usable. When they do not, no rung is bounded: each frees its cached blocks after its turn
(``torch.cuda.empty_cache``) and runs one untimed step at the start of the next, so the allocations a freed cache
makes again are not timed; a CUDA-graph rung's private pool stays held (empty_cache does not free it), which the
note counts: when those pools and the largest other rung exceed the device, a rung may still fail, and it says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mfu_lab.core.job.rules import captures_cuda_graphs

USABLE = 0.92  # of the device's memory, what the rungs' processes share (the CUDA contexts and fragmentation: the rest)
GiB = 2**30


@dataclass
class MemoryPlan:
    fractions: dict[str, float] = field(default_factory=dict)  # rung -> its process's share of the device
    release: bool = False  # the rungs do not fit together: each frees its cache after its turn, unbounded
    needs: dict[str, float] = field(default_factory=dict)  # rung -> bytes (analytic upper bound)
    note: str = ""


def plan(micro_batches: dict[str, int], job_micro_batch: int, peak_bytes: float | None,
         capacity_bytes: float, graphs: frozenset[str] = frozenset()) -> MemoryPlan:
    """The shares of the rungs ``micro_batches`` (rung -> its job's micro_batch, the rungs that run) on a device of
    ``capacity_bytes``, from step 1's measured ``peak_bytes`` at ``job_micro_batch`` (None: not measured).
    ``graphs``: the rungs compiled in a CUDA-graph mode, whose pools stay held when the others free their caches."""
    names = list(micro_batches)
    if not names:
        return MemoryPlan()
    if not peak_bytes or peak_bytes <= 0 or job_micro_batch <= 0:
        share = USABLE / len(names)
        return MemoryPlan({n: share for n in names}, note=(
            f"each of the {len(names)} rungs may hold {share:.0%} of the device (equal shares: step 1 measured no "
            "peak memory to size them by)"))
    needs = {n: peak_bytes * max(1.0, mb / job_micro_batch) for n, mb in micro_batches.items()}
    total, usable = sum(needs.values()), USABLE * capacity_bytes
    sizes = ", ".join(f"{n} {b / GiB:.1f} GiB" for n, b in needs.items())
    basis = (f"step 1's peak {peak_bytes / GiB:.1f} GiB at micro_batch {job_micro_batch} x each rung's micro_batch "
             "over it (analytic, an upper bound)")
    if total <= usable:
        fractions = {n: USABLE * b / total for n, b in needs.items()}
        return MemoryPlan(fractions, needs=needs, note=(
            f"each rung may hold its need's share of {usable / GiB:.0f} GiB usable: {sizes}, by {basis}"))
    held = sum(needs[n] for n in graphs if n in needs)
    largest = max((b for n, b in needs.items() if n not in graphs), default=0.0)
    risk = (f"; even so the CUDA-graph rungs' pools ({', '.join(n for n in needs if n in graphs)}: about "
            f"{held / GiB:.0f} GiB, never freed) and the largest other rung ({largest / GiB:.0f} GiB) exceed what is "
            "usable, so a rung may fail for memory: its failure is recorded and the others are measured"
            if held + largest > usable else
            "" if not held else f"; the CUDA-graph rungs' pools (about {held / GiB:.0f} GiB) stay held throughout")
    return MemoryPlan({}, release=True, needs=needs, note=(
        f"the rungs need about {total / GiB:.0f} GiB together ({sizes}, by {basis}), over the {usable / GiB:.0f} "
        "GiB usable: no rung is bounded; each frees its cached memory after its turn and runs one untimed step at "
        f"the start of the next{risk}"))


def graph_rungs(rungs, jobs) -> frozenset[str]:
    """The names of the rungs whose jobs capture CUDA graphs (core.job.rules.captures_cuda_graphs)."""
    return frozenset(r.name for r, j in zip(rungs, jobs) if captures_cuda_graphs(j.compile_mode, j.compile_options))


def for_device(device, micro_batches: dict[str, int], job_micro_batch: int, baseline: dict | None,
               graphs: frozenset[str] = frozenset()) -> MemoryPlan | None:
    """:func:`plan` on a CUDA ``device`` (core.measure.device's), from step 1's stored result ``baseline``; None
    elsewhere (a CPU process needs no share of a device)."""
    if device.type != "cuda":
        return None
    import torch

    peak = (((baseline or {}).get("metrics") or {}).get("peak_memory_bytes") or {}).get("value")
    capacity = torch.cuda.get_device_properties(device.torch_device).total_memory  # pragma: no cover - GPU only
    return plan(micro_batches, job_micro_batch, peak, capacity, graphs)  # pragma: no cover - GPU only
