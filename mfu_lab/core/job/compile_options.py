"""The inductor options a job may give (``compile_options``): a named list of performance knobs, each with the
values it takes.

``torch.compile(options=...)`` sets ``torch._inductor.config`` by name, and some of its settings name code or a
place: ``cpp.cxx`` is the C++ compiler inductor runs (a job file naming a script there ran it at every compile),
others name folders, modules or Python callables. So a job's options are an allow-list, not a free mapping: the
knobs people tune for speed (names as in torch 2.13's ``torch/_inductor/config.py``), whose values are true/false,
whole numbers in a range, or one of a few words. Anything else is refused with the names allowed
(:func:`options_problem`); the engine checks again before it compiles (``core.engine.workload.compile_kwargs``).
"""

from __future__ import annotations

from typing import Any

BOOL = ("bool",)
GEMM_BACKENDS = ("ATEN", "TRITON", "CPP", "CUTLASS", "CUTEDSL", "NVGEMM", "CK", "CKTILE")
CONV_BACKENDS = ("ATEN", "TRITON")


def _int(lo: int, hi: int) -> tuple:
    return ("int", lo, hi)


def _words(*words: str) -> tuple:
    return ("word", words)


def _backends(*names: str) -> tuple:
    return ("backends", names)


# name -> the values it takes: BOOL, ("int", lo, hi), ("word", words), ("backends", names: a comma list of them)
INDUCTOR_OPTIONS: dict[str, tuple] = {
    # autotuning
    "max_autotune": BOOL,
    "max_autotune_pointwise": BOOL,
    "max_autotune_gemm": BOOL,
    "max_autotune_gemm_backends": _backends(*GEMM_BACKENDS),
    "max_autotune_conv_backends": _backends(*CONV_BACKENDS),
    "max_autotune_gemm_search_space": _words("DEFAULT", "EXHAUSTIVE"),
    "autotune_fallback_to_aten": BOOL,
    "coordinate_descent_tuning": BOOL,
    "coordinate_descent_check_all_directions": BOOL,
    "coordinate_descent_search_radius": _int(1, 64),
    # fusion and scheduling
    "epilogue_fusion": BOOL,
    "epilogue_fusion_first": BOOL,
    "aggressive_fusion": BOOL,
    "benchmark_fusion": BOOL,
    "benchmark_epilogue_fusion": BOOL,
    "benchmark_kernel": BOOL,
    "max_fusion_size": _int(1, 4096),
    "pattern_matcher": BOOL,
    "group_fusion": BOOL,
    "permute_fusion": BOOL,
    "combo_kernels": BOOL,
    "reorder_for_locality": BOOL,
    "reorder_for_peak_memory": BOOL,
    "reorder_for_compute_comm_overlap": BOOL,
    "split_reductions": BOOL,
    "unroll_reductions_threshold": _int(1, 1024),
    "realize_reads_threshold": _int(1, 1024),
    "realize_opcount_threshold": _int(1, 65536),
    "online_softmax": BOOL,
    "use_mixed_mm": BOOL,
    "conv_1x1_as_mm": BOOL,
    "decompose_mem_bound_mm": BOOL,
    "memory_planning": BOOL,
    # layout and padding
    "shape_padding": BOOL,
    "comprehensive_padding": BOOL,
    "force_shape_pad": BOOL,
    "padding_alignment_bytes": _int(1, 4096),
    "padding_stride_threshold": _int(1, 1 << 20),
    "layout_optimization": BOOL,
    "freezing": BOOL,
    # checks and numerics
    "size_asserts": BOOL,
    "fallback_random": BOOL,
    "emulate_precision_casts": BOOL,
    # the compile's own worker processes
    "compile_threads": _int(1, 256),
    # GPU kernels (Triton)
    "triton.cudagraphs": BOOL,
    "triton.cudagraph_trees": BOOL,
    "triton.cudagraph_skip_dynamic_graphs": BOOL,
    "triton.cudagraph_support_input_mutation": BOOL,
    "triton.autotune_pointwise": BOOL,
    "triton.autotune_cublasLt": BOOL,
    "triton.persistent_reductions": BOOL,
    "triton.cooperative_reductions": BOOL,
    "triton.prefer_nd_tiling": BOOL,
    "triton.max_tiles": _int(1, 3),
    "triton.tiling_prevents_pointwise_fusion": BOOL,
    "triton.tiling_prevents_reduction_fusion": BOOL,
    "triton.use_block_ptr": BOOL,
    "triton.dense_indexing": BOOL,
    "triton.divisible_by_16": BOOL,
    "triton.codegen_upcast_to_fp32": BOOL,
    "triton.enable_persistent_tma_matmul": BOOL,
    "triton.multi_kernel": _int(0, 3),
    "triton.spill_threshold": _int(0, 1024),
    # CPU kernels (C++)
    "cpp.threads": _int(-1, 1024),
    "cpp.dynamic_threads": BOOL,
    "cpp.simdlen": _int(0, 2048),
    "cpp.min_chunk_size": _int(1, 1 << 20),
    "cpp.max_horizontal_fusion_size": _int(1, 1024),
    "cpp.weight_prepack": BOOL,
    "cpp.enable_tiling_heuristics": BOOL,
    "cpp.enable_loop_tail_vec": BOOL,
    "cpp.enable_concat_linear": BOOL,
    "cpp.enable_unsafe_math_opt_flag": BOOL,
    "cpp.gemm_max_k_slices": _int(0, 1024),
}


def _takes(kind: tuple) -> str:
    if kind == BOOL:
        return "true or false"
    if kind[0] == "int":
        return f"a whole number from {kind[1]} to {kind[2]}"
    if kind[0] == "word":
        return "one of " + ", ".join(kind[1])
    return "a comma-separated list of " + ", ".join(kind[1]) + " (e.g. ATEN,TRITON)"


def value_problem(name: str, value: Any) -> str | None:
    """Why ``value`` is not one option ``name`` takes (None when it is); ``name`` must be in the list."""
    kind = INDUCTOR_OPTIONS[name]
    if kind == BOOL:
        ok = isinstance(value, bool)
    elif kind[0] == "int":
        ok = isinstance(value, int) and not isinstance(value, bool) and kind[1] <= value <= kind[2]
    elif kind[0] == "word":
        ok = isinstance(value, str) and value.upper() in kind[1]
    else:
        parts = value.upper().split(",") if isinstance(value, str) else []
        ok = bool(parts) and all(p.strip() in kind[1] for p in parts)
    return None if ok else f"item {name!r}: {value!r}: must be {_takes(kind)}"


def options_problem(options: dict) -> str | None:
    """Why the mapping ``options`` is not a set of inductor options a job may give (None when it is): every name
    in :data:`INDUCTOR_OPTIONS` and every value one that name takes. A value that names a program, a path or a
    module cannot pass: no option listed takes one."""
    for name, value in options.items():
        if name not in INDUCTOR_OPTIONS:
            return (f"item {name!r}: not an inductor option a job may give (options that name a program, a path, a "
                    "module or code are never taken from a job file); allowed: "
                    + ", ".join(INDUCTOR_OPTIONS))
        why = value_problem(name, value)
        if why:
            return why
    return None


def options_text(options: dict) -> str:
    """The options as one line, ``name=value, ...`` ('(none)' for an empty mapping)."""
    return ", ".join(f"{k}={v!r}" for k, v in options.items()) or "(none)"
