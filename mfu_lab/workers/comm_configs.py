"""Step 2's candidates, the data-parallel family: DDP configurations (hook x bucket size x gradient_as_bucket_view)
and FSDP2 configurations (reshard_after_forward x explicit prefetch x MixedPrecisionPolicy reduce_dtype): the whole
product (``comm_screen: product``, ``thorough``), or by default each knob varied alone (:func:`factor_configs`).

A candidate is a plain dict, as the launcher hands it to the ranks (JSON): a DDP one ``{"hook", "bucket_mb",
"grad_as_bucket_view"}``, an FSDP2 one ``{"kind": "fsdp", "reshard", "prefetch", "reduce_dtype"}``. Its key (a tuple)
and its name (as the race, the report and the advice say it) come from here, for both kinds.
"""

from __future__ import annotations

import dataclasses

from mfu_lab.core.job.schema import Job

FSDP = "fsdp"


def is_fsdp(cfg: dict) -> bool:
    return cfg.get("kind") == FSDP


def ddp_configs(job: Job) -> list[dict]:
    """Hook x bucket size (largest first: a hook that hangs at one size is not tried at smaller ones) x view."""
    return [{"hook": h, "bucket_mb": b, "grad_as_bucket_view": g}
            for h in job.comm_hooks for b in sorted(job.comm_bucket_mb, reverse=True)
            for g in job.comm_grad_as_bucket_view]


def fsdp_configs(job: Job) -> list[dict]:
    """reshard_after_forward x prefetch depth x reduce dtype (empty lists: no FSDP2 candidate)."""
    return [{"kind": FSDP, "reshard": bool(r), "prefetch": int(p), "reduce_dtype": d}
            for r in job.comm_fsdp_reshard for p in job.comm_fsdp_prefetch for d in job.comm_fsdp_reduce_dtype]


def sweep_configs(job: Job) -> list[dict]:
    """Every candidate of step 2's race: the DDP configurations, then the FSDP2 ones."""
    return ddp_configs(job) + fsdp_configs(job)


def factor_configs(job: Job, own: dict) -> list[dict]:
    """Step 2's factor screen (``comm_screen: factors``): the job's own DDP settings ``own``, then each swept knob's
    other values alone (hooks, bucket sizes largest first, gradient_as_bucket_view), the rest held at the job's; then
    FSDP2 from the job's own fsdp_* settings (each list's first value where the job's is not in it), varied the same
    way. A one-factor-at-a-time design: it measures what each knob gives alone and never a combination of two
    changed knobs (``comm_screen: product`` races every combination)."""
    out: list[dict] = []
    seen: set[tuple] = set()

    def vary(base: dict, knobs: tuple) -> None:
        for c in [base] + [base | {k: v} for k, levels in knobs for v in levels]:
            if config_key(c) not in seen:
                seen.add(config_key(c))
                out.append(c)

    vary(dict(own), (("hook", job.comm_hooks), ("bucket_mb", sorted(job.comm_bucket_mb, reverse=True)),
                     ("grad_as_bucket_view", job.comm_grad_as_bucket_view)))
    lists = (job.comm_fsdp_reshard, job.comm_fsdp_prefetch, job.comm_fsdp_reduce_dtype)
    if all(lists):
        mine = (bool(job.fsdp_reshard_after_forward), int(job.fsdp_prefetch), job.fsdp_reduce_dtype or "float32")
        r, p, d = (v if v in levels else levels[0] for v, levels in zip(mine, lists))
        vary({"kind": FSDP, "reshard": bool(r), "prefetch": int(p), "reduce_dtype": d},
             (("reshard", [bool(x) for x in lists[0]]), ("prefetch", [int(x) for x in lists[1]]),
              ("reduce_dtype", list(lists[2]))))
    return out


def screened_configs(job: Job, own: dict) -> list[dict]:
    """The candidates step 2 races: the factor screen, or the whole product (``comm_screen: product``, or
    ``thorough``, which measures every combination in full), with the job's own DDP settings always in."""
    if job.comm_screen == "factors" and not job.thorough:
        return factor_configs(job, own)
    configs = sweep_configs(job)
    return configs if config_key(own) in {config_key(c) for c in configs} else configs + [dict(own)]


def config_key(cfg: dict) -> tuple:
    if is_fsdp(cfg):
        return FSDP, bool(cfg["reshard"]), int(cfg["prefetch"]), str(cfg["reduce_dtype"])
    return cfg["hook"], float(cfg["bucket_mb"]), bool(cfg["grad_as_bucket_view"])


def config_name(cfg: dict) -> str:
    """A candidate as the race and the report name it: hook/bucketMB/view or copy (DDP), or
    ``fsdp reshard=true prefetch=1 reduce=bfloat16`` (FSDP2)."""
    if is_fsdp(cfg):
        return (f"fsdp reshard={'true' if cfg['reshard'] else 'false'} prefetch={int(cfg['prefetch'])} "
                f"reduce={cfg['reduce_dtype']}")
    return f"{cfg['hook']}/{cfg['bucket_mb']:g}MB/{'view' if cfg['grad_as_bucket_view'] else 'copy'}"


def hook_of(cfg: dict) -> str:
    """The DDP hook that sets a candidate's warm-up (:func:`mfu_lab.workers.ddp_rank.ddp_warmup`): FSDP2 warms up as
    DDP without a hook does, so every candidate's loss is read after the same number of steps on the same batches."""
    return "none" if is_fsdp(cfg) else cfg["hook"]


def fsdp_job_keys(cfg: dict) -> dict:
    """The job keys that make a job train as this FSDP2 candidate (dp_mode fsdp and the fsdp_* keys)."""
    return {"dp_mode": "fsdp", "fsdp_reshard_after_forward": bool(cfg["reshard"]),
            "fsdp_prefetch": int(cfg["prefetch"]), "fsdp_reduce_dtype": cfg["reduce_dtype"]}


def fsdp_job(job: Job, cfg: dict) -> Job:
    """``job`` as this FSDP2 candidate trains it (parameters computed in the job's dtype)."""
    return dataclasses.replace(job, **fsdp_job_keys(cfg))


def bf16_hook_allowed() -> bool:
    """Whether DDP's register_comm_hook accepts bf16_compress_hook in this torch build: torch's own condition
    (torch/nn/parallel/distributed.py, 2.11 and 2.13 alike): a CUDA or ROCm build with NCCL 2.10+, or XPU with
    XCCL. It is a property of the build, not of the backend the ranks use."""
    import torch
    import torch.distributed as dist

    cuda = torch.version.cuda is not None or torch.version.hip is not None
    try:
        nccl = dist.is_available() and dist.is_nccl_available() and torch.cuda.nccl.version() >= (2, 10)
    except (RuntimeError, AttributeError):  # a build whose NCCL cannot say its version
        nccl = False
    xccl = dist.is_available() and getattr(dist, "is_xccl_available", lambda: False)() and torch.xpu.is_available()
    return bool((cuda and nccl) or xccl)


def known_refusal(cfg: dict, backend: str, grad_bytes: int) -> str | None:
    """Why ``backend`` refuses ``cfg`` before any launch, from its known limits; None when it may run.

    - bf16_compress on gloo, where this torch build has no NCCL 2.10+ (a CPU build): DDP's register_comm_hook
      raises "BF16 all reduce communication hook required CUDA 11+ and NCCL 2.10+" (torch/nn/parallel/
      distributed.py). A CUDA build runs it on gloo too (seen with torch 2.11+cu130 on a CPU), so it is tried.
    - powersgd on gloo with more than one gradient bucket: gloo aborts the whole launch with an enforce failure
      (seen by this workbook's step 2 with torch 2.13 on CPU: 8 MB buckets of the default job's 14.3 MB of
      gradients), which costs a relaunch; one bucket (bucket_cap_mb at least the gradients' size) runs.
    Anything not listed here is tried.
    """
    if backend != "gloo" or is_fsdp(cfg):
        return None
    if cfg["hook"] == "bf16_compress" and not bf16_hook_allowed():
        return ("gloo: bf16_compress_hook needs a torch build with CUDA 11+ and NCCL 2.10+, and this one has "
                "none (torch raises a TypeError); not launched")
    if cfg["hook"] == "powersgd" and grad_bytes > cfg["bucket_mb"] * 2**20:
        return (f"gloo: PowerSGD with more than one gradient bucket ({grad_bytes / 2**20:.1f} MB of gradients in "
                f"{cfg['bucket_mb']:g} MB buckets) aborts the launch with a gloo enforce failure; not launched")
    return None
