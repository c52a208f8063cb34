"""Job parameters: one flat set of typed keys, read from YAML or a notebook.

A job file is a flat YAML mapping so that the same file works with
``mfu-lab run JOB``, ``papermill NB OUT -f JOB`` and ``papermill ... -p key value``
(papermill overrides top-level names only). Every key is declared once, in
:class:`Job`, with its type, its default (the embedded default job, which
``parameters/default.yaml`` repeats) and what values it allows. Validation
collects every problem and raises one :class:`JobError` naming the source,
each key, the value given and what is allowed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.job import yamlfile
from mfu_lab.core.job.factories import anchored_factory_paths, factory_key_problems
from mfu_lab.core.job.paths import anchored_paths, find_workbook_root, input_path, job_file_folder
from mfu_lab.core.job.rules import (
    ADAMW_IMPLS,
    ATTENTIONS,
    CHECKPOINT_POLICIES,
    COMM_HOOKS,
    COMM_SCREENS,
    COMPILE_CHOICES,
    COMPILE_DYNAMIC,
    COMPILE_MODES,
    DATA_DTYPES,
    DATA_SOURCES,
    DEVICES,
    DP_MODES,
    DTYPES,
    FP8_RECIPES,
    JOB_NAME_RE,
    LAST_BATCH,
    LOSS_IMPLS,
    MATMUL_PRECISIONS,
    MODEL_RE,
    PP_SCHEDULES,
    PRECISION_RUNGS,
    SEQ_POLICIES,
    TP_STYLES,
    cross_key_problems,
    data_problems,
    factory_keys,
    rule_problem,
    type_problem,
    unknown_key_problem,
)

__all__ = ["ADAMW_IMPLS", "ATTENTIONS", "CHECKPOINT_POLICIES", "COMM_HOOKS", "COMPILE_CHOICES", "COMPILE_DYNAMIC",
           "COMPILE_MODES",
           "DATA_DTYPES", "DATA_SOURCES", "DEVICES", "DP_MODES", "DTYPES", "FIELDS", "FP8_RECIPES", "JOB_NAME_RE",
           "KEY_GROUPS", "LAST_BATCH", "LOSS_IMPLS", "MATMUL_PRECISIONS", "MODEL_RE", "PP_SCHEDULES", "PRECISION_RUNGS",
           "SEQ_POLICIES", "TP_STYLES", "Job", "JobError", "JobProblem", "find_workbook_root",
           "load_job", "validate"]


def _key(default, help: str, **rules):
    """A job key: its default, a one-line help, and its rules (min, choices...)."""
    if isinstance(default, (dict, list)):
        kw = {"default_factory": lambda: type(default)(default)}
    else:
        kw = {"default": default}
    return field(metadata={"help": help, **rules}, **kw)


@dataclass
class Job:
    """A training job to measure. Defaults are the embedded default job (CPU-sized)."""

    # --- job ---
    job_name: str = _key("default", "names the output folder <out_dir>/<job_name>", pattern="job_name")
    device: str = _key("auto", "auto | cpu | cuda", choices=DEVICES)
    out_dir: str = _key("outputs", "results folder; a relative path is taken from the checkout holding the job file, "
                        "else from the current folder (README, 'Job files')")
    seed: int = _key(0, "seed for weights and synthetic data", min=0)
    keep: list = _key([], "job keys the tuned job (outputs/<job>/tuned.yaml) keeps at this file's values, whatever "
                      "the steps recommend, e.g. [dtype, compile_mode]", items="key", empty=True)
    monitor_dir: str = _key("", "the folder mfu_lab.monitor.Monitor writes in this job's production runs; the "
                            "index then shows what it measured and the ledger's operations bar uses it; a relative "
                            "path is looked for next to the job file, then in the checkout; empty for none")
    # --- the workbook's own cost ---
    thorough: bool = _key(False, "exhaustive sweeps: every candidate of steps 2, 4 and 5 measured in full and warm "
                          "compiles always timed (mfu-lab run --thorough); false races them (README, 'Cost')")
    budget_min: float = _key(0.0, "minutes the run's steps may take in all, spread over the steps by the rule in the "
                             "README ('Cost'); each step shortens to fit and says what it left out; 0: no budget",
                             min=0.0)
    race_steps: int = _key(2, "measured steps of each candidate in a racing sweep's first round (step 2: "
                           "attention, DDP)",
                           min=2)
    # --- model ---
    model: str = _key("gpt", "'gpt' (the reference decoder) or 'package.module:function'", pattern="model")
    model_kwargs: dict = _key({}, "keyword arguments passed to a module:function model")
    factory_paths: list = _key([], "folders a module:function model may also come from, besides the job file's own "
                               "folder; a relative path is taken from the job file's folder (README, 'Your own "
                               "model')", items="folder", empty=True)
    trust: list = _key([], "installed packages (top-level names, e.g. [transformers]) a module:function model may "
                       "come from; never mfu_lab or the standard library", items="package", empty=True)
    n_layers: int = _key(4, "transformer blocks (reference model)", min=1)
    n_heads: int = _key(4, "attention heads; must divide d_model", min=1)
    d_model: int = _key(256, "hidden size", min=1)
    vocab_size: int = _key(2048, "token vocabulary (0: the model's input embedding size, the default for a model "
                           "factory; the reference gpt takes 2048)", min=0)
    seq_len: int = _key(256, "tokens per sample (token ids only; other batches keep their own shapes)", min=1)
    attention: str = _key("sdpa", "sdpa (fused scaled_dot_product_attention) | unfused (explicit softmax(QK^T)V)",
                          choices=ATTENTIONS)
    activation_checkpointing: bool = _key(False, "recompute each block's activations in backward (raises HFU, not MFU; "
                                          "the reference gpt's blocks)")
    checkpoint_policy: str = _key("full", "what a checkpointed block recomputes (with activation_checkpointing: true): "
                                  "full (its whole forward, matmuls included: about a third more compute) | selective "
                                  "(keeps the matmul and fused-attention outputs, recomputes norms, GELU and the "
                                  "other cheap ops: torch.utils.checkpoint.create_selective_checkpoint_contexts)",
                                  choices=CHECKPOINT_POLICIES)
    # --- data ---
    data: str = _key("synthetic", "synthetic: seeded random token ids through a real DataLoader | synthetic_varlen: "
                     "the same with sample lengths varying in [min_seq_len, seq_len] | tokens:PATH: a flat token file "
                     "(nanoGPT's train.bin) read with numpy.memmap | hf:PATH: a Hugging Face dataset saved with "
                     "save_to_disk | package.module:function: your own Dataset, IterableDataset, DataLoader or "
                     "iterable of batches (README, 'Your own model and data')", pattern="data")
    data_dtype: str = _key("uint16", "tokens:PATH files: the token dtype, uint16 (nanoGPT's) | uint32",
                           choices=DATA_DTYPES)
    data_column: str = _key("input_ids", "hf:PATH datasets: the column of token ids (or of text, with tokenizer)")
    tokenizer: str = _key("", "hf:PATH datasets of text: the folder of a tokenizer saved with save_pretrained, "
                          "loaded offline ('': the column holds token ids)")
    loss: str = _key("", "the loss: '' (the output's .loss when the model computes one from labels, else "
                     "cross-entropy of its logits) | package.module:function of (output, batch)", pattern="loss")
    min_seq_len: int = _key(0, "shortest sample of synthetic_varlen (0: seq_len // 2)", min=0)
    seq_policy: str = _key("longest", "how samples of different lengths form a batch: longest (pad to the batch's "
                           "longest) | pad (to seq_len) | bucket (to the next of seq_buckets lengths) | pack (end to "
                           "end, cut at seq_len)", choices=SEQ_POLICIES)
    seq_buckets: int = _key(4, "bucket lengths for seq_policy: bucket (evenly spaced up to seq_len)", min=1)
    last_batch: str = _key("drop", "a last batch short of micro_batch: drop | keep (a smaller batch) | pad (rows of "
                           "padding)", choices=LAST_BATCH)
    dataset_samples: int = _key(0, "samples in one epoch of the data (0: as many as the steps need); step 4's shape "
                                "audit reads one epoch", min=0)
    num_workers: int = _key(0, "DataLoader worker processes (0: load in the training process)", min=0)
    prefetch_factor: int = _key(2, "batches each worker loads ahead (used when num_workers > 0)", min=1)
    pin_memory: bool = _key(False, "pin host batches for faster copies (CUDA only; ignored on CPU)")
    persistent_workers: bool = _key(False, "keep the DataLoader's worker processes between epochs (num_workers > 0)")
    synthetic_load_ms: float = _key(0.0, "simulated loading latency per batch, in ms, added to any data kind (a "
                                    "sleep standing in for storage or decoding)", min=0.0)
    # --- training ---
    micro_batch: int = _key(8, "samples per micro-batch: one forward and backward (an optimizer step is grad_accum "
                            "of them)", min=1)
    grad_accum: int = _key(1, "micro-batches per optimizer step (gradient accumulation): an optimizer step trains "
                           "on micro_batch x grad_accum samples per data-parallel rank, its loss the mean over all "
                           "their useful tokens; DDP and FSDP2 reduce gradients on the last micro-batch only. steps, "
                           "warmup_steps, verify_steps and fp8_steps count optimizer steps; a step's time and FLOPs "
                           "are those of grad_accum micro-batches", min=1)
    steps: int = _key(20, "measured training steps (at least 2, so a spread exists)", min=2)
    warmup_steps: int = _key(3, "training steps run first and discarded", min=0)
    dtype: str = _key("float32", "float32 | bfloat16 | float16 (the latter two through autocast)", choices=DTYPES)
    matmul_precision: str = _key("highest", "float32 matmuls: highest (true float32) | high (TF32 on GPUs that have "
                                 "it; no effect on CPUs)", choices=MATMUL_PRECISIONS)
    compile_mode: str = _key("off", "the job trains under torch.compile in this mode: off (eager) | "
                             + " | ".join(COMPILE_MODES) + " | options (compile_options)", choices=COMPILE_CHOICES)
    lr: float = _key(3e-4, "AdamW learning rate", min_exclusive=0.0)
    adamw_impl: str = _key("default", "AdamW's implementation: default (torch's choice) | foreach (multi-tensor "
                           "kernels) | fused (a few fused kernels; CUDA, and CPU since torch 2.4)", choices=ADAMW_IMPLS)
    loss_impl: str = _key("eager", "how the default cross-entropy runs: eager (from the logits, cast to float32, "
                          "outside any compiled region) | compiled (inside torch.compile: with the forward as one "
                          "region under compile_mode, alone when compile_mode is off) | chunked "
                          "(F.linear_cross_entropy from the hidden states and the head's weight, never writing "
                          "the logits; torch 2.13+, a model with an lm_head Linear, no loss: factory, compile_mode "
                          "off)", choices=LOSS_IMPLS)
    loss_tolerance: float = _key(0.02, "relative final-loss gap to the original job that a lossy change (lower "
                                 "precision, gradient compression) may reach and still be adopted",
                                 min_exclusive=0.0)
    # --- device ---
    peak_flops: float | None = _key(None, "peak FLOP/s for the training dtype, or per dtype as {float32: 6.7e13, "
                                   "bfloat16: 9.9e14}; overrides the table / measurement for that dtype only",
                                   min_exclusive=0.0, optional=True, per_dtype=True)
    # --- distributed (step 2) ---
    nproc_per_node: int = _key(0, "processes per node for DDP (0: one per visible GPU, or 2 on CPU)", min=0)
    nnodes: int = _key(1, "nodes in the DDP launch (more than 1 needs rdzv_endpoint)", min=1)
    rdzv_endpoint: str = _key("", "host:port of the rendezvous for multi-node launches ('' on one node)")
    ddp_bucket_mb: float = _key(25.0, "the job's DDP bucket_cap_mb (25: DDP's default)", min_exclusive=0.0)
    ddp_hook: str = _key("none", "the job's DDP communication hook: " + " | ".join(COMM_HOOKS), choices=COMM_HOOKS)
    ddp_grad_as_bucket_view: bool = _key(False, "the job's DDP gradient_as_bucket_view")
    comm_bucket_mb: list = _key([1, 8, 25, 100], "DDP bucket_cap_mb values to sweep", items="positive_number")
    comm_hooks: list = _key(list(COMM_HOOKS), "DDP communication hooks to sweep: " + " | ".join(COMM_HOOKS),
                            items="hook")
    comm_grad_as_bucket_view: list = _key([False, True], "gradient_as_bucket_view values to sweep", items="bool")
    comm_screen: str = _key("factors", "which candidates step 2's race screens: 'factors' (the job's own DDP and "
                            "FSDP2 settings, then each swept knob's other values one at a time, e.g. 9 DDP + 4 FSDP2 "
                            "on the default job) or 'product' (every combination of the comm_* lists, 48 + 8); "
                            "--thorough measures the product in full", choices=COMM_SCREENS)
    comm_fsdp_reshard: list = _key([True, False], "FSDP2 candidates of step 2's race: reshard_after_forward values "
                                   "(with comm_fsdp_prefetch and comm_fsdp_reduce_dtype, one at a time or every "
                                   "combination: comm_screen); [] in all three: no FSDP2 candidate", items="bool",
                                   empty=True)
    comm_fsdp_prefetch: list = _key([0, 1], "FSDP2 candidates: explicit prefetch depths in blocks (as fsdp_prefetch; "
                                    "0: FSDP's implicit prefetch); [] in all three comm_fsdp_* keys: none",
                                    items="count", empty=True)
    comm_fsdp_reduce_dtype: list = _key(["float32", "bfloat16"], "FSDP2 candidates: MixedPrecisionPolicy "
                                        "reduce_dtype values (" + " | ".join(DTYPES) + "); a lossy one is adopted "
                                        "only with the loss within loss_tolerance; [] in all three comm_fsdp_* "
                                        "keys: none", items="dtype", empty=True)
    comm_steps: int = _key(3, "measured DDP steps per configuration (and as many under no_sync)", min=2)
    comm_warmup_steps: int = _key(1, "discarded DDP steps per configuration", min=0)
    comm_timeout_s: float = _key(60.0, "a DDP launch with no finished step for this long is ended as hung",
                                 min_exclusive=0.0)
    # --- layout: how the job itself is split over its ranks (README, "Your job's layout") ---
    dp_mode: str = _key("ddp", "data parallel: ddp (replicated, today's default) | fsdp (FSDP2 fully_shard per block "
                        "and at the root)", choices=DP_MODES)
    fsdp_reshard_after_forward: bool = _key(True, "FSDP2 (dp_mode: fsdp): free the gathered parameters after "
                                            "forward (gather again in backward)")
    fsdp_prefetch: int = _key(0, "FSDP2 (dp_mode: fsdp): explicit forward and backward prefetch depth in "
                              "blocks (0: FSDP's implicit prefetch)", min=0)
    fsdp_param_dtype: str = _key("", "FSDP2 (dp_mode: fsdp) MixedPrecisionPolicy param_dtype ('': the job's dtype)",
                                 choices=("", *DTYPES))
    fsdp_reduce_dtype: str = _key("", "FSDP2 (dp_mode: fsdp) MixedPrecisionPolicy reduce_dtype ('': float32)",
                                  choices=("", *DTYPES))
    tp: int = _key(1, "tensor-parallel degree of the job (1: none); must divide the heads (n_heads for gpt); tp x pp "
                   "must divide the world (nproc_per_node x nnodes)", min=1)
    sp: bool = _key(False, "sequence parallel on top of tensor parallel (needs tp > 1)")
    pp: int = _key(1, "pipeline stages of the job (1: none); pp x pp_virtual_stages must divide the blocks (n_layers "
                   "for gpt)", min=1)
    pp_schedule: str = _key("1f1b", "pipeline schedule: " + " | ".join(PP_SCHEDULES), choices=PP_SCHEDULES)
    pp_microbatches: int = _key(4, "micro-batches each rank's micro_batch is split into under pp > 1 (at least pp; "
                                "must divide micro_batch)", min=1)
    pp_virtual_stages: int = _key(1, "model chunks per pipeline rank (interleaved_1f1b needs 2 or more)", min=1)
    tp_plan: dict = _key({}, "tensor-parallel plan of a user's model: module-name pattern -> colwise | rowwise | "
                         "sequence ({}: the built-in plan of the reference GPT or a Llama-style model)",
                         items="tp_style")
    # --- kernels (step 3) ---
    profile_warmup_steps: int = _key(2, "profiled steps run first and not recorded (the profiler warms up)", min=0)
    profile_steps: int = _key(3, "training steps recorded by torch.profiler", min=1)
    top_n: int = _key(20, "rows of the kernel (GPU) / operator (CPU) table", min=1)
    profile_ddp: bool = _key(True, "also profile the job data-parallel in step 2's layout, one trace per rank")
    # --- compile (step 4) ---
    compile_modes: list = _key(["default", "max-autotune-no-cudagraphs", "reduce-overhead"],
                               "torch.compile modes to try: " + " | ".join(COMPILE_MODES)
                               + " (CUDA-graph modes are skipped on CPU)", items="compile_mode")
    compile_backend: str = _key("inductor", "torch.compile backend (inductor; aot_eager or eager to check dynamo "
                                "alone)")
    compile_options: dict = _key({}, "inductor options; when given, one more trial compiles with these options "
                                 "instead of a mode", items="inductor_option")
    compile_dynamic: str = _key("auto", "dynamic shapes: auto (torch's default: static, then dynamic after a "
                                "change) | static (dynamic False) | dynamic (dynamic True)", choices=COMPILE_DYNAMIC)
    compile_warmup_steps: int = _key(2, "first compiled steps, where compilation happens (their extra time is the "
                                     "compile time)", min=1)
    compile_timeout_s: float = _key(900.0, "a compile trial running longer than this is ended and recorded",
                                    min_exclusive=0.0)
    # --- FP8 (step 5) ---
    precision_rungs: list = _key(list(PRECISION_RUNGS), "lower precisions step 5 tries against float32 before FP8: "
                                 + " | ".join(PRECISION_RUNGS) + " (tf32 on GPUs only)", items="precision", empty=True)
    precision_rounds: int = _key(3, "interleaved timing rounds of each precision (step 5)", min=1)
    fp8_recipe: str = _key("tensorwise", "FP8 scaling recipe (torchao's names): " + " | ".join(FP8_RECIPES),
                           choices=FP8_RECIPES)
    fp8_layers: list = _key([], "layer groups that train in FP8 in this job (step 5 writes this line for you): "
                            "torchao float8 training where the device has FP8 units, else the job trains without "
                            "it and step 1 says why; [] for none", items="name", empty=True)
    fp8_policies: dict = _key({}, "more policies to try: name -> list of layer groups, e.g. {attn: [attn_qkv, "
                              "attn_out]}")
    fp8_steps: int = _key(30, "training steps of each FP8 policy trial (same seed, same batches)", min=2)
    fp8_sensitivity_batches: int = _key(2, "batches whose layer inputs and gradients measure FP8 error", min=1)
    fp8_tolerance: float = _key(0.02, "relative loss above the reference that a policy may reach", min_exclusive=0.0)
    fp8_window: int = _key(5, "steps averaged by the divergence watch and the final comparison", min=1)
    fp8_spike: float = _key(10.0, "a gradient norm this many times the median so far stops a trial",
                            min_exclusive=1.0)
    # --- placement (step 6) ---
    cluster: str = _key("parameters/clusters/example_h100.yaml", "cluster file (switches, nodes, GPUs, links; see "
                        "parameters/clusters/); a relative path is looked for next to the job file, then in "
                        "the checkout, then in the workbook's own parameters/")
    gpus: int = _key(0, "GPUs the job is placed on (0: the efficient size the sweep finds)", min=0)
    cluster_tp: int = _key(0, "step 6: tensor-parallel size on the cluster (0: the fastest the model finds); must "
                           "divide n_heads", min=0)
    cluster_pp: int = _key(0, "step 6: pipeline stages on the cluster (0: the fastest the model finds); must divide "
                           "n_layers", min=0)
    cluster_interleave: int = _key(1, "step 6: interleaved pipeline chunks per stage on the cluster (Megatron-LM's "
                                   "virtual stages)", min=1)
    global_batch: int = _key(512, "samples per optimizer step on the cluster (data parallel x micro-batches x "
                             "micro_batch); a multiple of micro_batch (the job's own step holds micro_batch x "
                             "grad_accum x its data-parallel ranks)", min=1)
    assumed_mfu: float = _key(0.4, "single-GPU MFU the model assumes when no earlier step measured the cluster's "
                              "GPU", min_exclusive=0.0)
    min_marginal_efficiency: float = _key(0.8, "the efficient size is the largest whose added GPUs still bring this "
                                          "share of the per-GPU throughput", min_exclusive=0.0)
    placement_jobs: int = _key(2, "copies of the job sharing the cluster in the whole-rack vs interleaved comparison",
                               min=1)
    placement_layouts: bool = _key(True, "step 6: measure every layout this node's ranks can form (one torchrun "
                                   "launch) before modelling the cluster; false skips it")
    coloc_steps: int = _key(8, "measured steps of the co-location experiment (the job alone, then two copies at once)",
                            min=2)
    # --- verify (step 7) ---
    verify_rounds: int = _key(10, "interleaved rounds of the verify step's staircase (each rung runs once per round)",
                              min=2)
    verify_steps: int = _key(4, "measured steps of each rung per round (step 7)", min=1)
    verify_warmup_steps: int = _key(3, "steps each rung runs first and discards (compilation happens here)", min=0)

    # ------------------------------------------------------------------ helpers
    @property
    def tokens_per_step(self) -> int:
        """Token positions of one optimizer step on one rank: ``grad_accum`` micro-batches of micro_batch x seq_len
        (a step time, a step's FLOPs and its tokens are all an optimizer step's)."""
        return self.micro_batch * self.grad_accum * self.seq_len

    @property
    def uses_reference_model(self) -> bool:
        return self.model == "gpt"

    def _repr_html_(self) -> str:
        """A notebook shows the job as a table of key, value and help."""
        from html import escape

        left = 'style="text-align:left"'
        rows = "".join(f"<tr><td {left}><code>{escape(k)}</code></td><td {left}>{escape(repr(v))}</td>"
                       f"<td {left}><small>{escape(FIELDS[k].metadata['help'])}</small></td></tr>"
                       for k, v in self.to_dict().items())
        return (f"<table><tr><th {left}>key</th><th {left}>value</th><th {left}>meaning</th></tr>{rows}</table>")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def output_root(self, workbook_root: Path | None = None) -> Path:
        """``<out_dir>/<job_name>``, with a relative out_dir taken from the workbook root
        (:mod:`mfu_lab.core.job.paths`; a job loaded from a file outside that root holds its out_dir already made
        absolute)."""
        base = Path(self.out_dir).expanduser()
        if not base.is_absolute():
            base = (workbook_root or find_workbook_root()) / base
        return base / self.job_name

    def step_dir(self, step_folder: str) -> Path:
        return self.output_root() / step_folder

    def monitor_path(self, workbook_root: Path | None = None) -> Path | None:
        """The job's monitor folder (a relative path taken from the workbook root), None when not named."""
        return input_path(self.monitor_dir, "monitor_dir", root=workbook_root) if self.monitor_dir else None

    def cluster_path(self, workbook_root: Path | None = None) -> Path:
        """The job's cluster file: a relative path taken from the workbook root, else from the workbook's own
        files (``parameters/clusters/`` of the checkout the package runs from, or of the installed package)."""
        return input_path(self.cluster, "cluster", root=workbook_root)


FIELDS = {f.name: f for f in dataclasses.fields(Job)}
# The keys' groups, by the first key of each, in declaration order: `mfu-lab keys` and the notebooks' parameters
# cells (tools/sync_parameters.py) head each group with its title.
KEY_GROUPS = {"job_name": "job", "thorough": "the workbook's own cost", "model": "model", "data": "data",
              "micro_batch": "training", "peak_flops": "device", "nproc_per_node": "distributed (step 2)",
              "dp_mode": "layout (the job's own: FSDP, TP, SP, PP)",
              "profile_warmup_steps": "kernels (step 3)", "compile_modes": "compile (step 4)",
              "precision_rungs": "FP8 (step 5)", "cluster": "placement (step 6)", "verify_rounds": "verify (step 7)"}


def validate(values: dict[str, Any], source: str, folder: Path | None = None) -> Job:
    """Check ``values`` (key -> value) against :class:`Job`; return the Job or raise JobError.

    Missing keys take their defaults. Unknown keys, wrong types and impossible
    values are all reported together. ``folder``: the job file's folder, where a factory's module may lie and
    relative ``factory_paths`` start (None: the current folder; :mod:`mfu_lab.core.job.factories`). Imports nothing.
    """
    problems: list[JobProblem] = []
    clean: dict[str, Any] = {}
    for key, value in values.items():
        if not isinstance(key, str) or key not in FIELDS:
            problems.append(unknown_key_problem(key, value, FIELDS))
            continue
        value, why = type_problem(FIELDS[key], value, FIELDS)
        why = why or rule_problem(key, FIELDS[key].metadata, value)
        if why:
            problems.append(JobProblem(key, value, why))
        else:
            clean[key] = value
    bad = {p.key for p in problems}
    if "vocab_size" not in values and clean.get("model", "gpt") != "gpt":
        clean["vocab_size"] = 0  # a factory's vocabulary is its input embedding's
    job = Job(**clean)  # the clean keys over the defaults: cross-key checks of keys that are fine on their own
    problems += cross_key_problems(job, bad) + factory_key_problems(job, bad, folder, factory_keys(job))
    problems += data_problems(job, bad, folder)
    if problems:
        raise JobError(source, problems)
    return job


def load_job(path: str | Path, overrides: dict[str, Any] | None = None, anchor: bool = True) -> Job:
    """Read and validate a job file (safe YAML). ``overrides`` win over the file.

    Relative paths the file gives (``cluster``, ``monitor_dir``) are looked for in the file's folder first, and a
    file in a checkout takes ``out_dir`` from that checkout (:mod:`mfu_lab.core.job.paths`): where that puts them
    elsewhere than the same text would point without the file, the job holds them as absolute paths. A factory's
    module is looked for beside the file and in ``factory_paths`` taken from the file's folder; the job holds those
    folders as absolute paths, the file's own first when the factory lies there (:mod:`mfu_lab.core.job.factories`).
    ``anchor=False`` reads the file as the embedded default job (relative paths from the workbook root)."""
    path = Path(path)
    if not path.is_file():
        raise JobError(str(path), [JobProblem("(file)", str(path), "no such job file")])
    try:
        data = yamlfile.load(path)
    except yamlfile.YamlProblem as e:
        raise JobError(str(path), [JobProblem("(file)", path.name, str(e))]) from None
    if data is None or data == {}:  # 0 bytes, only comments, or `{}`: a truncated copy or a wrong path
        raise JobError(str(path), [JobProblem("(file)", path.name,
                                              "sets no key (empty, or only comments): a job file names at least one "
                                              "key; for the default job give no file (mfu-lab run)")])
    if not isinstance(data, dict):
        raise JobError(str(path), [JobProblem("(file)", type(data).__name__,
                                              "must be a mapping of key: value lines")])
    written = {k for k in data if isinstance(k, str)} - set(overrides or {})
    data.update(overrides or {})
    try:
        job = validate(data, str(path), job_file_folder(path) if anchor else None)
    except JobError as e:  # a mistake in -p KEY=VALUE is the command line's, not the file's
        given = {k for k in overrides or {}}
        mine = [p for p in e.problems if p.key in given]
        if mine:
            where = "command line (-p KEY=VALUE)" if len(mine) == len(e.problems) else \
                f"{path} and the command line (-p KEY=VALUE)"
            raise JobError(where, e.problems) from None
        raise
    # relative paths taken from the job file's folder are made absolute: a notebook's kernel gets them as values
    anchored = anchored_paths(job.to_dict(), path, written) if anchor else {}
    factory_paths = (anchored_factory_paths(tuple(getattr(job, k) for k in factory_keys(job)), job_file_folder(path),
                                           job.factory_paths) if anchor else None)
    if factory_paths is not None:  # a factory beside the job file, relative factory_paths: from the file's folder
        anchored["factory_paths"] = factory_paths
    return dataclasses.replace(job, **anchored) if anchored else job
