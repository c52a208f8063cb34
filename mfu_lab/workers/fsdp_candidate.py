"""An FSDP2 candidate of step 2's race, inside the step-2 worker (:mod:`mfu_lab.workers.ddp_rank`).

The model is laid out by the job's own machinery (:func:`mfu_lab.core.engine.parallelize.parallelize`: ``fully_shard``
per block, then the root, with the candidate's ``reshard_after_forward``, explicit prefetch depth and
MixedPrecisionPolicy ``reduce_dtype``) over a one-dimensional data-parallel mesh of every rank. The worker then
measures it with DDP's protocol: the same batches per rank, the same warm-up, timed steps, one profiled step (its
collectives: all-gathers and reduce-scatters), and the same steps with gradient synchronisation off
(``set_requires_gradient_sync(False)``, FSDP2's ``no_sync``: the reduce-scatters stop, the all-gathers stay).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from mfu_lab.core.engine.layout import Layout, build_mesh
from mfu_lab.core.engine.parallelize import Parallelized, parallelize
from mfu_lab.core.job.schema import Job
from mfu_lab.workers.comm_configs import fsdp_job

_MESHES: dict[tuple, object] = {}  # one mesh per launch: a new DeviceMesh would create new process groups

# gloo's and NCCL's names for the collectives FSDP2 issues (torch 2.13: all_gather_into_tensor, reduce_scatter_tensor,
# and all_reduce where the backend has no reduce-scatter)
FSDP_COLLECTIVES = ("gloo:all_gather", "gloo:allgather", "gloo:_allgather", "gloo:reduce_scatter",
                    "gloo:_reduce_scatter", "gloo:all_reduce", "gloo:allreduce")


class FSDPCandidate:
    """What the worker needs of a candidate: ``step(x, y)`` (one optimizer step, the loss), ``no_sync()``, and
    ``module`` (the root module)."""

    def __init__(self, par: Parallelized):
        self.par = par
        self.module = par.modules[0]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.par.step(x, y)

    @contextlib.contextmanager
    def no_sync(self):
        """FSDP2's gradients kept local: no reduce-scatter (the parameters are still all-gathered)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)


def build(job: Job, cfg: dict, model: nn.Module, device: torch.device, world: int) -> FSDPCandidate:
    """``model`` (built with the job's seed, the same on every rank) laid out as the FSDP2 candidate ``cfg``."""
    cand = fsdp_job(job, cfg)
    layout = Layout.from_job(cand, world)
    key = (device.type, layout.shape)
    if key not in _MESHES:
        _MESHES[key] = build_mesh(layout, device.type)
    return FSDPCandidate(parallelize(model, cand, layout, _MESHES[key], device))


def comm_seconds(prof, device_type: str, cpu_names: tuple[str, ...] = FSDP_COLLECTIVES) -> float:
    """Seconds in the collectives of the profiled step (the union of their spans), from the profiler: NCCL kernels'
    device time on a GPU; on a CPU gloo's events named ``cpu_names`` (FSDP2's gathers and reduce-scatters by
    default)."""
    spans = []
    for ev in prof.events():
        name = ev.name.lower()
        if device_type == "cuda":
            hit = name.startswith("nccl") and ev.device_type == torch.autograd.DeviceType.CUDA
        else:
            hit = name.startswith(cpu_names)
        if hit:
            spans.append((ev.time_range.start, ev.time_range.end))
    total, end = 0.0, -1.0
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total / 1e6
