"""Command-line overrides (``-p KEY=VALUE``, ``--budget``, ``--thorough``), kept beside the figures they produced.

``mfu-lab run`` and ``mfu-lab step`` set ``MFU_LAB_OVERRIDES`` (JSON: key -> value, ``out_dir`` left out) for the
length of the run; a notebook's kernel inherits it. Every step's result records it as
``environment["overrides"]`` (:func:`mfu_lab.core.store.results.environment`), empty when there were none, so the index,
every step's report and ``tuned.yaml`` say which values came from the command line rather than the job file.

Workload overrides are those that change the job measured: :data:`WORKLOAD_KEYS` and :data:`LAYOUT_KEYS`. A step 1
measured with one is not "the job as it came". The others (the steps' sweeps and run lengths, ``--budget``,
``--thorough``, bookkeeping such as ``job_name``) are still recorded and shown, but the job is the same.
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

OVERRIDES_ENV = "MFU_LAB_OVERRIDES"
# The job keys that define the workload measured: two steps measured with different values of these measured
# different jobs, so a comparison between them is not like for like (report.index.job_differences, report.found).
# Step-specific keys (sweeps, trial lengths) and bookkeeping are left out.
WORKLOAD_KEYS = ("model", "model_kwargs", "n_layers", "n_heads", "d_model", "vocab_size", "seq_len", "attention",
                 "activation_checkpointing", "checkpoint_policy",
                 "data", "min_seq_len", "seq_policy", "seq_buckets", "last_batch",
                 "dataset_samples", "num_workers", "prefetch_factor", "pin_memory", "synthetic_load_ms", "micro_batch",
                 "dtype", "matmul_precision", "compile_mode", "lr", "adamw_impl", "loss_impl", "device", "peak_flops",
                 "seed", "fp8_layers", "fp8_recipe", "ddp_bucket_mb", "ddp_hook", "ddp_grad_as_bucket_view")
# the job's layout: steps 1, 3 and 7 run the job in it, so an override of one changes what they measure
LAYOUT_KEYS = ("nproc_per_node", "nnodes", "dp_mode", "fsdp_reshard_after_forward", "fsdp_prefetch", "fsdp_param_dtype",
               "fsdp_reduce_dtype", "tp", "sp", "pp", "pp_schedule", "pp_microbatches", "pp_virtual_stages", "tp_plan")
# the options that set these keys (mfu_lab.commands.common.cost_overrides)
FLAGS = {"budget_min": "--budget", "thorough": "--thorough"}


def from_env() -> dict[str, Any]:
    """The overrides the runner handed down, or {} (none, or a value that is no JSON object)."""
    try:
        d = json.loads(os.environ.get(OVERRIDES_ENV) or "{}")
    except ValueError:
        return {}
    return {str(k): v for k, v in d.items()} if isinstance(d, dict) else {}


def recorded(result: Any) -> dict[str, Any]:
    """The overrides a stored result was measured with ({} for none, or a result from before they were kept)."""
    env = result.get("environment") if isinstance(result, dict) else None
    o = env.get("overrides") if isinstance(env, dict) else None
    return o if isinstance(o, dict) else {}


def workload(overrides: dict[str, Any]) -> dict[str, Any]:
    """The overrides that change the job measured."""
    return {k: v for k, v in overrides.items() if k in WORKLOAD_KEYS or k in LAYOUT_KEYS}


def _value(v: Any) -> str:
    """A value as it is typed after ``-p KEY=``: YAML's flow style (``16``, ``true``, ``[none, allreduce]``)."""
    if isinstance(v, str):
        return v
    text = yaml.safe_dump(v, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") else text


def flag(key: str, value: Any) -> str:
    """One override as it was typed: ``-p micro_batch=16``, ``--budget 5``, ``--thorough``."""
    if key == "thorough" and value is True:
        return FLAGS[key]
    if key in FLAGS:
        return f"{FLAGS[key]} {_value(value)}"
    return f"-p {key}={_value(value)}"


def flags(overrides: dict[str, Any]) -> str:
    """All of them, as typed: ``-p micro_batch=16 -p dtype=bfloat16``; '' for none."""
    return " ".join(flag(k, v) for k, v in overrides.items())


def pairs(overrides: dict[str, Any]) -> str:
    """``micro_batch=16, dtype=bfloat16``: the keys and values, for a line that says they are overrides."""
    return ", ".join(f"{k}={_value(v)}" for k, v in overrides.items())
