"""A job's layout: how its ranks split the work (data, tensor, sequence and pipeline parallel), and its mesh.

One record of the degrees, like torchtitan's ``ParallelDims``: built from the job and the world size
(``nnodes x nproc_per_node``), named for tables ("FSDP2xTP2"), and turned into one ``DeviceMesh`` whose
dimensions are always ("pp", "dp", "tp"), size-1 dimensions included (torch accepts them), so code can ask
``mesh["tp"]`` whatever the layout. The data-parallel degree is what is left of the world after tp x pp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mfu_lab.core.engine.layout_check import dp_degree
from mfu_lab.core.job.schema import Job

MESH_DIMS = ("pp", "dp", "tp")  # outermost first: pipeline stages span nodes, tensor parallel stays in a node
_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def beyond_ddp(job: Job) -> bool:
    """Whether the job trains in a layout of its own (FSDP, tensor or pipeline parallel) rather than replicated by
    DDP: steps 1, 3 and 7 then run it under torchrun in that layout. The same test as :attr:`Layout.is_plain_ddp`,
    without needing the world size."""
    return not (job.dp_mode == "ddp" and job.tp == 1 and job.pp == 1)


@dataclass(frozen=True)
class Layout:
    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    sp: bool = False
    dp_mode: str = "ddp"  # ddp | fsdp
    reshard_after_forward: bool = True  # FSDP2
    prefetch: int = 0  # FSDP2 explicit prefetch depth in blocks (0: FSDP's implicit prefetch)
    param_dtype: str = "float32"  # FSDP2 MixedPrecisionPolicy
    reduce_dtype: str = "float32"
    pp_schedule: str = "1f1b"
    pp_microbatches: int = 1
    pp_virtual_stages: int = 1

    @classmethod
    def from_job(cls, job: Job, world: int) -> Layout:
        """The job's layout over ``world`` ranks; tp x pp that does not divide the world is refused (JobError)."""
        return cls(world=world, dp=dp_degree(job, world), tp=job.tp, pp=job.pp, sp=job.sp and job.tp > 1,
                   dp_mode=job.dp_mode, reshard_after_forward=job.fsdp_reshard_after_forward,
                   prefetch=job.fsdp_prefetch, param_dtype=job.fsdp_param_dtype or job.dtype,
                   reduce_dtype=job.fsdp_reduce_dtype or "float32", pp_schedule=job.pp_schedule,
                   pp_microbatches=job.pp_microbatches if job.pp > 1 else 1,
                   pp_virtual_stages=job.pp_virtual_stages if job.pp > 1 else 1)

    @property
    def is_plain_ddp(self) -> bool:
        """Today's behaviour: a replicated model (DDP), no tensor or pipeline split."""
        return self.dp_mode == "ddp" and self.tp == 1 and self.pp == 1

    @property
    def fsdp(self) -> bool:
        return self.dp_mode == "fsdp"

    @property
    def stages(self) -> int:
        """Pipeline stages in all: pp x pp_virtual_stages model chunks."""
        return self.pp * self.pp_virtual_stages

    @property
    def name(self) -> str:
        """Short, for tables: "DDP2", "FSDP2 no-reshard", "TP2+SP", "PP2 interleaved_1f1b v2 m4", "FSDP2xTP2"."""
        parts = []
        if self.fsdp:
            fs = f"FSDP{self.dp}"
            if not self.reshard_after_forward:
                fs += " no-reshard"
            if self.prefetch:
                fs += f" prefetch{self.prefetch}"
            if self.param_dtype != "float32" or self.reduce_dtype != "float32":
                fs += f" mp {_SHORT[self.param_dtype]}/{_SHORT[self.reduce_dtype]}"
            parts.append(fs)
        elif self.dp > 1 or (self.tp == 1 and self.pp == 1):
            parts.append(f"DDP{self.dp}")
        if self.tp > 1:
            parts.append(f"TP{self.tp}" + ("+SP" if self.sp else ""))
        if self.pp > 1:
            v = f" v{self.pp_virtual_stages}" if self.pp_virtual_stages > 1 else ""
            parts.append(f"PP{self.pp} {self.pp_schedule}{v} m{self.pp_microbatches}")
        return "x".join(parts)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The mesh's sizes in MESH_DIMS order."""
        return self.pp, self.dp, self.tp

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_mesh(layout: Layout, device_type: str):
    """One ``DeviceMesh`` over every rank, dimensions named ("pp", "dp", "tp") in that order, sizes
    (pp, dp, tp); a size-1 dimension is kept so every name always exists. Needs the process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, layout.shape, mesh_dim_names=MESH_DIMS)
