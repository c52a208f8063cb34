"""The rules a job's keys are checked against: the allowed values, one key at a time, then across keys.

:func:`mfu_lab.core.job.schema.validate` runs them and raises one :class:`JobError` with every problem. This module
holds the checks and the value sets they use and imports nothing of :mod:`mfu_lab.core.job.schema` (which re-exports
the value sets): a check takes the key's dataclass field, or the :class:`~mfu_lab.core.job.schema.Job` built from the
keys that were fine on their own. The checks that need the world size or the model itself are in
:mod:`mfu_lab.core.engine.layout_check`.
"""

from __future__ import annotations

import dataclasses
import difflib
import keyword
import math
import re
import sys
from collections.abc import Collection
from typing import Any

from mfu_lab.core.errors import JobProblem, short_repr
from mfu_lab.core.job.compile_options import options_problem

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTIONS = ("sdpa", "unfused")
DATA_SOURCES = ("synthetic", "synthetic_varlen")  # besides tokens:PATH, hf:PATH and package.module:function
DATA_DTYPES = ("uint16", "uint32")
DATA_PREFIXES = ("tokens:", "hf:")
SEQ_POLICIES = ("longest", "pad", "bucket", "pack")
LAST_BATCH = ("drop", "keep", "pad")
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that capture CUDA graphs (on CUDA only)


def captures_cuda_graphs(mode: str, options: Any = None) -> bool:
    """Whether torch.compile as a job's ``compile_mode`` (and ``compile_options``) runs it captures CUDA graphs on a
    CUDA device: reduce-overhead and max-autotune, or ``options`` with inductor's ``triton.cudagraphs`` on."""
    return mode in CUDA_GRAPH_MODES or (mode == "options" and isinstance(options, dict)
                                        and bool(options.get("triton.cudagraphs")))
COMPILE_DYNAMIC = ("auto", "static", "dynamic")
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
COMM_HOOKS = ("none", "allreduce", "fp16_compress", "bf16_compress", "powersgd")
COMM_SCREENS = ("factors", "product")  # step 2's first round: knobs one at a time, or every combination
COMPILE_CHOICES = ("off", *COMPILE_MODES, "options")
MATMUL_PRECISIONS = ("highest", "high")
ADAMW_IMPLS = ("default", "foreach", "fused")
LOSS_IMPLS = ("eager", "compiled", "chunked")
CHECKPOINT_POLICIES = ("full", "selective")  # core.engine.checkpointing
PRECISION_RUNGS = ("tf32", "bfloat16", "float16")
DP_MODES = ("ddp", "fsdp")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
SINGLE_STAGE_SCHEDULES = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle: one model chunk per rank
TP_STYLES = ("colwise", "rowwise", "sequence")
FSDP_KEYS = ("fsdp_reshard_after_forward", "fsdp_prefetch", "fsdp_param_dtype", "fsdp_reduce_dtype")
JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MODEL_RE = re.compile(r"^(gpt|[A-Za-z_][\w.]*:[A-Za-z_]\w*)$")
FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_BASE60_TEXT = re.compile(r"^[+-]?\d[\d_]*(:[0-5]?\d)+(\.\d*)?$")  # YAML 1.1's base 60; the reader keeps it text

# Keys whose meaning changed (issue 28): step 6's cluster-scale tp, pp and interleave became cluster_tp, cluster_pp
# and cluster_interleave; the plain tp and pp are now the job's own layout. A job file written for the old names is
# told so in one line, with the new key, before the generic "did you mean" could suggest something else.
OLD_MEANINGS = {
    ("tp", 0): "tp is now the job's own tensor-parallel degree (>= 1); step 6's cluster choice is cluster_tp "
               "(0: the model picks)",
    ("pp", 0): "pp is now the job's own number of pipeline stages (>= 1); step 6's cluster choice is cluster_pp "
               "(0: the model picks)",
}
RENAMED_KEYS = {
    "interleave": "unknown key; did you mean 'cluster_interleave' (step 6's interleaved chunks per stage on the "
                  "cluster, formerly interleave) or 'pp_virtual_stages' (the job's own model chunks per pipeline "
                  "rank)?",
}


def unknown_key_problem(key: Any, value: Any, keys: Collection[str]) -> JobProblem:
    """A key that is not a job key: a renamed one says its new name, any other gets the nearest key, if any."""
    if isinstance(key, str) and key in RENAMED_KEYS:
        return JobProblem(key, value, RENAMED_KEYS[key])
    if not isinstance(key, str) or not key.isidentifier() or keyword.iskeyword(key):
        shown = short_repr(key, 60)[1:-1] if isinstance(key, str) else short_repr(key, 60)
        return JobProblem(shown, value, "not a Python name: papermill -f would run it as code (papermill writes "
                                        "each key as `key = value` into the notebook); refused. Run files you did "
                                        "not write with mfu-lab run or mfu-lab lab, which validate first")
    near = difflib.get_close_matches(str(key), keys, n=1)
    hint = f"did you mean '{near[0]}'? " if near else ""
    return JobProblem(str(key), value, f"unknown key; {hint}allowed keys: {', '.join(keys)}")


def type_problem(f: dataclasses.Field, value: Any, keys: Collection[str]) -> tuple[Any, str | None]:
    """Coerce ``value`` to the key's type; return (value, None) or (value, what is expected). ``keys``: every job
    key (a list of kind ``key`` names them)."""
    t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    meta = f.metadata
    if value is None:
        return value, None if meta.get("optional") else f"must be given (expected {t.replace(' | None', '')})"
    if meta.get("per_dtype"):
        return per_dtype_number(value)
    if t == "bool":
        return value, None if isinstance(value, bool) else "must be true or false"
    if isinstance(value, str) and _BASE60_TEXT.match(value.strip()) and t in ("int", "float", "float | None"):
        return value, (f"must be a number, not {value!r}: YAML 1.1 reads numbers with colons as base 60 (1:30 as "
                       "90), so the workbook keeps them as text and refuses them; write the number itself, e.g. 90")
    if t == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            return value, "must be a whole number"
        if abs(value) >= 2 ** 53:
            return value, "must be below 2**53 (larger whole numbers cannot be stored exactly in the result files)"
        return value, None
    if t.startswith("float"):
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)  # YAML 1.1 reads 989e12 (no dot) as text
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, "must be a number"
        value = float(value)
        return value, None if math.isfinite(value) else "must be a finite number"
    if t == "str":
        return value, None if isinstance(value, str) else "must be text"
    if t == "list":
        if not isinstance(value, list) or (not value and not meta.get("empty")):
            return value, "must be a non-empty list, e.g. [1, 8, 25]"
        if meta["items"] == "positive_number":  # YAML 1.1 reads 1e-9 (no dot) as text, as for a scalar key
            value = [float(v) if isinstance(v, str) and _FLOAT_TEXT.match(v.strip()) else v for v in value]
        return value, items_problem(meta["items"], value, keys)
    if t == "dict":
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return value, "must be a mapping of names to values"
        return value, mapping_problem(meta["items"], value) if "items" in meta else None
    raise AssertionError(f"unhandled type {t} for {f.name}")  # pragma: no cover - schema bug


def _finite_positive(value: Any) -> float | None:
    """``value`` as a float when it is a finite number > 0 (number text such as YAML's ``6.7e13`` included)."""
    if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not value > 0:
        return None
    return float(value)


def per_dtype_number(value: Any) -> tuple[Any, str | None]:
    """A key that is one number (for the job's own dtype) or a mapping dtype -> number (``peak_flops``): every
    number finite and > 0, every dtype one of :data:`DTYPES`. Returns (the value as floats, None) or (value, why)."""
    allowed = (f"one finite number > 0 (FLOP/s for the job's dtype), or a mapping of dtypes ({', '.join(DTYPES)}) "
               "to finite numbers > 0, e.g. {float32: 6.7e13, bfloat16: 9.9e14}")
    if isinstance(value, dict):
        if not value:
            return value, f"must not be an empty mapping; expected {allowed}"
        out = {}
        for k, v in value.items():
            if k not in DTYPES:
                return value, f"item {k!r}: not a dtype; each key must be one of {', '.join(DTYPES)}"
            out[k] = _finite_positive(v)
            if out[k] is None:
                return value, f"item {k}: {v!r}: each value must be a finite number > 0 (FLOP/s)"
        return out, None
    number = _finite_positive(value)
    return (number, None) if number is not None else (value, f"must be {allowed}")


def items_problem(kind: str, items: list, keys: Collection[str]) -> str | None:
    for v in items:
        if kind == "positive_number" and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0
                                          or not math.isfinite(v)):
            return f"item {v!r}: every item must be a finite number > 0"
        if kind == "hook" and v not in COMM_HOOKS:
            return f"item {v!r}: every item must be one of {', '.join(COMM_HOOKS)}"
        if kind == "name" and (not isinstance(v, str) or not v):
            return f"item {v!r}: every item must be a non-empty name"
        if kind == "compile_mode" and v not in COMPILE_MODES:
            return f"item {v!r}: every item must be one of {', '.join(COMPILE_MODES)}"
        if kind == "precision" and v not in PRECISION_RUNGS:
            return f"item {v!r}: every item must be one of {', '.join(PRECISION_RUNGS)}"
        if kind == "key" and (not isinstance(v, str) or v not in keys):
            if isinstance(v, str) and v in RENAMED_KEYS:
                return f"item {v!r}: not a job key; {RENAMED_KEYS[v].removeprefix('unknown key; ')}"
            near = difflib.get_close_matches(str(v), keys, n=1)
            return f"item {v!r}: not a job key" + (f" (did you mean '{near[0]}'?)" if near else "")
        if kind == "folder" and (not isinstance(v, str) or not v.strip() or "\x00" in v):
            return f"item {v!r}: every item must be a folder path (text, not empty)"
        if kind == "package" and (not isinstance(v, str) or not v.isidentifier() or keyword.iskeyword(v)):
            return f"item {v!r}: every item must be a top-level package name, e.g. transformers (no dots)"
        if kind == "package" and (v == "mfu_lab" or v == "builtins" or v in sys.stdlib_module_names):
            return (f"item {v!r}: mfu_lab's own code and Python's standard library are never trusted: a job file "
                    "that names code runs that code; name installed packages that hold model factories")
        if kind == "count" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            return f"item {v!r}: every item must be a whole number >= 0"
        if kind == "dtype" and v not in DTYPES:
            return f"item {v!r}: every item must be one of {', '.join(DTYPES)}"
        if kind == "bool" and not isinstance(v, bool):
            return f"item {v!r}: every item must be true or false"
    if len(set(map(repr, items))) != len(items):
        return "items must not repeat"
    return None


def mapping_problem(kind: str, mapping: dict) -> str | None:
    """The entries of a mapping key (its keys are text already)."""
    if kind == "inductor_option":
        return options_problem(mapping)
    for k, v in mapping.items():
        if kind == "tp_style":
            if not k.strip():
                return f"item {k!r}: every key must be a non-empty module-name pattern, e.g. 'layers.*.attn.q'"
            if v not in TP_STYLES:
                return f"item {k!r}: {v!r}: every value must be one of {', '.join(TP_STYLES)}"
    return None


def rule_problem(name: str, meta: dict, value: Any) -> str | None:
    """The key's own rule (choices, bounds, patterns), after its type was checked; a value the key had under its
    old meaning (``tp: 0``) is told the new key instead."""
    if value is None:
        return None
    if not isinstance(value, (dict, list)) and (name, value) in OLD_MEANINGS and not isinstance(value, bool):
        return OLD_MEANINGS[(name, value)]
    if "choices" in meta and value not in meta["choices"]:
        return f"must be one of {', '.join(meta['choices'])}"
    if "min" in meta and value < meta["min"]:
        return f"must be >= {meta['min']}"
    if "min_exclusive" in meta and not isinstance(value, dict) and value <= meta["min_exclusive"]:
        return f"must be > {meta['min_exclusive']}"
    if meta.get("pattern") == "job_name" and not JOB_NAME_RE.fullmatch(value):
        return ("must be 1-64 characters of letters, digits, '_', '.', '-', starting with a letter or digit "
                "(it names a folder, so no path separators)")
    if name == "out_dir" and (not value.strip() or any(ord(c) < 32 or ord(c) == 127 for c in value)):
        return ("must be a folder path on one line: not empty, and no newline, tab, NUL or other control character "
                "(it names folders and is printed in commands and reports, like job_name)")
    if meta.get("pattern") == "data" and value not in DATA_SOURCES and not (
            value.startswith(DATA_PREFIXES) and value.split(":", 1)[1].strip()) and not FACTORY_RE.fullmatch(value):
        return ("must be one of " + ", ".join(DATA_SOURCES) + ", tokens:PATH (a flat token file), hf:PATH (a "
                "dataset saved with save_to_disk) or package.module:function (your own data)")
    if meta.get("pattern") == "loss" and value and not FACTORY_RE.fullmatch(value):
        return "must be '' (the model's own loss, else cross-entropy) or package.module:function of (output, batch)"
    if meta.get("pattern") == "model" and not MODEL_RE.fullmatch(value):
        return "must be 'gpt' or 'package.module:function' (a function returning an nn.Module)"
    return None


def cross_key_problems(job: Any, bad: set[str]) -> list[JobProblem]:
    """Checks across keys of ``job`` (a Job of the keys that were fine on their own); a check that involves a key
    in ``bad`` (already refused) is skipped."""
    problems: list[JobProblem] = []
    if not bad & {"d_model", "n_heads"}:
        if job.d_model % job.n_heads:
            problems.append(JobProblem("n_heads", job.n_heads, f"must divide d_model ({job.d_model})"))
    if not bad & {"nnodes", "rdzv_endpoint"}:
        if job.nnodes > 1 and not job.rdzv_endpoint:
            problems.append(JobProblem("rdzv_endpoint", job.rdzv_endpoint,
                                       f"must be host:port when nnodes is {job.nnodes}"))
        if job.rdzv_endpoint and not re.fullmatch(r"[\w.\-\[\]:]+:\d+", job.rdzv_endpoint):
            problems.append(JobProblem("rdzv_endpoint", job.rdzv_endpoint, "must be host:port, e.g. node01:29500"))
    if not bad & {"min_seq_len", "seq_len"} and job.min_seq_len > job.seq_len:
        problems.append(JobProblem("min_seq_len", job.min_seq_len, f"must be <= seq_len ({job.seq_len})"))
    if not bad & {"seq_buckets", "seq_len"} and job.seq_buckets > job.seq_len:
        problems.append(JobProblem("seq_buckets", job.seq_buckets, f"must be <= seq_len ({job.seq_len})"))
    if not bad & {"global_batch", "micro_batch"} and job.global_batch % job.micro_batch:
        problems.append(JobProblem("global_batch", job.global_batch, f"must be a multiple of micro_batch "
                                   f"({job.micro_batch})"))
    if not bad & {"cluster_tp", "n_heads"} and job.cluster_tp and job.n_heads % job.cluster_tp:
        problems.append(JobProblem("cluster_tp", job.cluster_tp, f"must divide n_heads ({job.n_heads})"))
    if not bad & {"cluster_pp", "n_layers"} and job.cluster_pp and job.n_layers % job.cluster_pp:
        problems.append(JobProblem("cluster_pp", job.cluster_pp, f"must divide n_layers ({job.n_layers})"))
    if not bad & {"min_marginal_efficiency"} and job.min_marginal_efficiency > 1:
        problems.append(JobProblem("min_marginal_efficiency", job.min_marginal_efficiency, "must be <= 1 (1 is "
                                   "perfect scaling)"))
    if not bad & {"loss_impl", "loss"} and job.loss_impl == "chunked" and job.loss:
        problems.append(JobProblem("loss_impl", job.loss_impl, f"chunked computes cross-entropy from the hidden "
                                   f"states and the head's weight, and cannot run the job's own loss ({job.loss}); "
                                   "use eager or compiled"))
    if not bad & {"loss_impl", "compile_mode"} and job.loss_impl == "chunked" and job.compile_mode != "off":
        problems.append(JobProblem("loss_impl", job.loss_impl, f"chunked does not combine with a compiled region "
                                   f"(compile_mode is {job.compile_mode}; torch.compile falls back to eager at the "
                                   "chunked operator); use compiled, or compile_mode: off"))
    if not bad & {"activation_checkpointing", "model"} and job.activation_checkpointing and job.model != "gpt":
        problems.append(JobProblem("activation_checkpointing", True, f"checkpoints the reference gpt's blocks only; a "
                                   f"model factory ({job.model}) checkpoints inside its own forward "
                                   "(torch.utils.checkpoint), which the workbook measures as it is: set it false"))
    if not bad & {"checkpoint_policy", "activation_checkpointing"} and job.checkpoint_policy != "full" \
            and not job.activation_checkpointing:
        problems.append(JobProblem("checkpoint_policy", job.checkpoint_policy, "takes effect only with "
                                   "activation_checkpointing: true; set both, or leave checkpoint_policy at full"))
    if not bad & {"assumed_mfu"} and job.assumed_mfu > 1:
        problems.append(JobProblem("assumed_mfu", job.assumed_mfu, "must be <= 1 (a fraction of peak)"))
    return problems + fsdp_candidate_problems(job, bad) + layout_problems(job, bad)


FSDP_CANDIDATE_KEYS = ("comm_fsdp_reshard", "comm_fsdp_prefetch", "comm_fsdp_reduce_dtype")


def fsdp_candidate_problems(job: Any, bad: set[str]) -> list[JobProblem]:
    """Step 2's FSDP2 candidates are the product of the three comm_fsdp_* lists: one empty list alone would silently
    drop them all, so an empty list is accepted only when all three are empty (no FSDP2 candidate)."""
    if bad & set(FSDP_CANDIDATE_KEYS):
        return []
    empty = [k for k in FSDP_CANDIDATE_KEYS if not getattr(job, k)]
    if not empty or len(empty) == len(FSDP_CANDIDATE_KEYS):
        return []
    return [JobProblem(k, [], "must not be empty while " + " and ".join(x for x in FSDP_CANDIDATE_KEYS if x not in
                                                                        empty)
                       + " list values: FSDP2 candidates are the product of the three lists; give [] in all three "
                       "(comm_fsdp_reshard, comm_fsdp_prefetch, comm_fsdp_reduce_dtype) to race no FSDP2 candidate")
            for k in empty]


def layout_problems(job: Any, bad: set[str]) -> list[JobProblem]:
    """The job's own layout (dp_mode, fsdp_*, tp, sp, pp, pp_*, tp_plan) against its other keys, where the keys
    alone show it; the world size and a factory model's heads and blocks are checked by
    :func:`mfu_lab.core.engine.layout_check.check_layout`."""
    problems: list[JobProblem] = []

    def ok(*keys: str) -> bool:
        return not bad & set(keys)

    gpt = job.model == "gpt"
    if ok("sp", "tp") and job.sp and job.tp < 2:
        problems.append(JobProblem("sp", job.sp, f"needs tp > 1 (tp is {job.tp}): sequence parallel splits the "
                                   "activations over the tensor-parallel ranks"))
    if ok("tp", "n_heads", "model") and gpt and job.n_heads % job.tp:
        problems.append(JobProblem("tp", job.tp, f"must divide n_heads ({job.n_heads}; {job.n_heads} % {job.tp} = "
                                   f"{job.n_heads % job.tp}): tensor parallel gives each rank whole heads"))
    stages = job.pp * job.pp_virtual_stages
    if ok("pp", "pp_virtual_stages", "n_layers", "model") and gpt and job.n_layers % stages:
        problems.append(JobProblem("pp" if job.pp > 1 else "pp_virtual_stages", job.pp if job.pp > 1 else
                                   job.pp_virtual_stages,
                                   f"pp x pp_virtual_stages ({job.pp} x {job.pp_virtual_stages} = {stages}) must "
                                   f"divide n_layers ({job.n_layers}): each model chunk holds whole blocks"))
    if ok("pp", "grad_accum") and job.pp > 1 and getattr(job, "grad_accum", 1) > 1:
        problems.append(JobProblem("grad_accum", job.grad_accum, f"must be 1 when pp is {job.pp}: a pipeline "
                                   "accumulates over its own pp_microbatches; raise pp_microbatches instead"))
    if ok("pp", "pp_microbatches") and job.pp > 1 and job.pp_microbatches < job.pp:
        problems.append(JobProblem("pp_microbatches", job.pp_microbatches, f"must be >= pp ({job.pp}): every "
                                   "stage needs a micro-batch in flight (torch's Schedule1F1B refuses fewer)"))
    if ok("pp_schedule", "pp_virtual_stages"):
        if job.pp_schedule == "interleaved_1f1b" and job.pp_virtual_stages < 2:
            problems.append(JobProblem("pp_virtual_stages", job.pp_virtual_stages, "must be >= 2 when pp_schedule "
                                       "is interleaved_1f1b (each rank holds pp_virtual_stages model chunks); with "
                                       "one chunk per rank use 1f1b"))
        if job.pp_schedule in SINGLE_STAGE_SCHEDULES and job.pp_virtual_stages > 1:
            problems.append(JobProblem("pp_virtual_stages", job.pp_virtual_stages, f"must be 1 when pp_schedule is "
                                       f"{job.pp_schedule} (a single-stage schedule: one model chunk per rank); "
                                       "interleaved_1f1b runs several chunks per rank"))
    if ok("pp", "pp_schedule", "pp_microbatches") and job.pp > 1 and job.pp_schedule == "interleaved_1f1b" \
            and job.pp_microbatches >= job.pp:
        # torch 2.13, torch/distributed/pipelining/schedules.py, ScheduleInterleaved1F1B.__init__:
        # number_of_rounds = max(1, n_microbatches // pp_group_size); n_microbatches % number_of_rounds must be 0
        # (a multiple of pp always passes; torch relaxed the paper's n_microbatches % pp == 0 to this)
        rounds = max(1, job.pp_microbatches // job.pp)
        if job.pp_microbatches % rounds:
            problems.append(JobProblem("pp_microbatches", job.pp_microbatches, f"must be a multiple of its rounds "
                                       f"under interleaved_1f1b with pp {job.pp}: torch's ScheduleInterleaved1F1B "
                                       f"runs max(1, pp_microbatches // pp) = {rounds} rounds and needs "
                                       f"pp_microbatches % {rounds} == 0 (a multiple of pp always does, e.g. "
                                       f"{job.pp_microbatches // job.pp * job.pp})"))
    if ok("pp", "pp_microbatches", "micro_batch") and job.pp > 1 and job.micro_batch % job.pp_microbatches:
        problems.append(JobProblem("micro_batch", job.micro_batch, f"must be a multiple of pp_microbatches "
                                   f"({job.pp_microbatches}) when pp is {job.pp}: the pipeline splits each data-"
                                   "parallel rank's micro_batch into pp_microbatches equal micro-batches"))
    if ok("dp_mode") and job.dp_mode == "ddp":
        defaults = {f.name: f.default for f in dataclasses.fields(job)}
        for key in FSDP_KEYS:
            if ok(key) and getattr(job, key) != defaults[key]:
                problems.append(JobProblem(key, getattr(job, key), f"needs dp_mode: fsdp (dp_mode is ddp, which "
                                           f"replicates the model; {key} is an FSDP2 setting; its default is "
                                           f"{defaults[key]!r})"))
    if ok("tp_plan", "model") and gpt and job.tp_plan:
        problems.append(JobProblem("tp_plan", job.tp_plan, "must be {} when model is gpt: the reference GPT has its "
                                   "built-in plan (tp_plan is for a model: package.module:function)"))
    return problems


def factory_keys(job: Any) -> tuple[str, ...]:
    """The keys of ``job`` that name code (``package.module:function``), checked under the factory rule."""
    keys = ["model"]
    if job.data not in DATA_SOURCES and not job.data.startswith(DATA_PREFIXES):
        keys.append("data")
    if job.loss:
        keys.append("loss")
    return tuple(keys)


def data_problems(job: Any, bad: set[str], folder: Any) -> list[JobProblem]:
    """The data keys against what is on disk: the token file or saved dataset exists and has the right shape; the
    vocabulary key fits the model kind. Opens no dataset and imports nothing."""
    from mfu_lab.core.job.paths import input_path

    problems: list[JobProblem] = []
    if not bad & {"vocab_size", "model"} and job.vocab_size == 1:
        problems.append(JobProblem("vocab_size", 1, "must be 0 (the model's input embedding size) or >= 2"))
    if not bad & {"vocab_size", "model"} and job.vocab_size == 0 and job.model == "gpt":
        problems.append(JobProblem("vocab_size", 0, "must be >= 2 for the reference gpt (0 takes the vocabulary "
                                   "from a model factory's input embedding)"))
    if "data" in bad:
        return problems
    kind = next((p for p in DATA_PREFIXES if job.data.startswith(p)), "")
    path = input_path(job.data[len(kind):].strip(), "data", folder) if kind else None
    if kind == "tokens:" and "data_dtype" not in bad:
        size = {"uint16": 2, "uint32": 4}[job.data_dtype]
        if not path.is_file():
            problems.append(JobProblem("data", job.data, f"no such token file ({path}); a relative path is taken "
                                       "from the job file's folder, then its checkout"))
        elif path.stat().st_size % size:
            problems.append(JobProblem("data", job.data, f"{path} holds {path.stat().st_size:,} bytes, not a whole "
                                       f"number of {job.data_dtype} tokens ({size} bytes each): is data_dtype right "
                                       f"({', '.join(DATA_DTYPES)})?"))
        elif "seq_len" not in bad and path.stat().st_size // size < job.seq_len + 2:
            problems.append(JobProblem("data", job.data, f"{path} holds {path.stat().st_size // size:,} tokens; a "
                                       f"sample takes seq_len + 1 ({job.seq_len + 1}) at a random offset"))
    if kind == "hf:" and not (path.is_dir() and any((path / f).is_file() for f in (
            "dataset_info.json", "state.json", "dataset_dict.json"))):
        problems.append(JobProblem("data", job.data, f"{path} is not a dataset saved with save_to_disk (a folder "
                                   "holding dataset_info.json or dataset_dict.json)"))
    if job.tokenizer and "tokenizer" not in bad:
        if kind != "hf:":
            problems.append(JobProblem("tokenizer", job.tokenizer, "is read only for data: hf:PATH (a dataset of "
                                       "text); token files and your own data bring token ids"))
        elif not input_path(job.tokenizer, "tokenizer", folder).is_dir():
            problems.append(JobProblem("tokenizer", job.tokenizer, f"no such folder "
                                       f"({input_path(job.tokenizer, 'tokenizer', folder)}): a tokenizer saved "
                                       "with save_pretrained"))
    if kind == "hf:" and not job.data_column.strip():
        problems.append(JobProblem("data_column", job.data_column, "must name the dataset's column of token ids "
                                   "(or of text, with tokenizer)"))
    return problems
