"""Every layout two CPU ranks can form, run on the job: step time, memory per rank, counted bytes per step.

    python benchmarks/bench_layouts.py [--job parameters/default.yaml] [--quick] [--steps N]

One torchrun launch (gloo, 2 ranks) runs DDP2, FSDP2 (reshard after forward on and off), TP2, TP2+SP and PP2
with the gpipe, 1f1b and interleaved 1F1B (2 virtual stages) schedules through
mfu_lab.workers.layout_launch.run_layouts: each is first checked against one process's loss, then timed. Prints
a markdown table. A few minutes on the default job with 2 cores; ``--quick`` takes a tiny job (under a minute).
CPU timings of collectives (gloo) do not transfer to GPUs; the counts and bytes do.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mfu_lab.core.job.schema import load_job  # noqa: E402
from mfu_lab.workers.layout_launch import LayoutRun, run_layouts  # noqa: E402

PP = {"pp": 2, "pp_microbatches": 4}
LAYOUTS = [{}, {"dp_mode": "fsdp"}, {"dp_mode": "fsdp", "fsdp_reshard_after_forward": False}, {"tp": 2},
           {"tp": 2, "sp": True}, PP | {"pp_schedule": "gpipe"}, PP | {"pp_schedule": "1f1b"},
           PP | {"pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}]
QUICK = dict(n_layers=4, n_heads=4, d_model=64, seq_len=32, vocab_size=256, micro_batch=8)
MIB = 2 ** 20


def mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def bytes_cell(counts: dict) -> str:
    """'allgather 10 x, 0.82 MiB; reduce_scatter ...' for one rank's counted step."""
    return "; ".join(f"{k} {v['count']}x {mib(v['bytes'])}" for k, v in sorted(counts.items())) or "none"


def row(r: LayoutRun) -> str:
    name = r.name
    if r.status != "ok":
        return f"| {name} | {r.status}: {r.reason[:80]} | | | | | | |"
    times = [statistics.median(t) for t in r.step_times_s]
    step = r.step_s()
    peak = " / ".join(mib(m["peak_bytes"]) for m in r.memory)
    shard = " / ".join(mib(sum(m["shard_bytes"].values())) for m in r.memory)
    bubble = ""
    if r.bubble:
        last = r.bubble["per_pp_rank"][-1]
        # the last pipeline rank: idle before its first forward and after its last backward
        bubble = f"{last['fraction']:.0%} (analytic {r.bubble['analytic_of_step']:.0%})"
    return (f"| {name} | {r.loss_check['max_rel_gap']:.1e} | {step * 1e3:.1f} | "
            f"{' / '.join(f'{t * 1e3:.1f}' for t in times)} | {r.tokens_per_step / step:,.0f} | {peak} | {shard} | "
            f"{bytes_cell(r.collectives[0])} | {bubble} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default=str(ROOT / "parameters" / "default.yaml"))
    ap.add_argument("--quick", action="store_true", help="a tiny job instead of the file's model and batch")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per layout (after the job's warm-up)")
    args = ap.parse_args()
    job = load_job(args.job)
    job = dataclasses.replace(job, nproc_per_node=2, device="cpu", comm_timeout_s=max(job.comm_timeout_s, 120.0),
                              compile_mode="off", **(QUICK if args.quick else {}))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        runs = run_layouts(job, "cpu", Path(work), [{"overrides": o} for o in LAYOUTS], steps=args.steps)
    print(f"job: {Path(args.job).name}{' --quick' if args.quick else ''}: {job.n_layers} layers, d_model "
          f"{job.d_model}, seq_len {job.seq_len}, micro_batch {job.micro_batch} per data-parallel rank, "
          f"{job.dtype}; 2 gloo ranks, {runs[0].threads_per_rank} thread(s) each; {args.steps} timed steps; "
          f"{time.perf_counter() - t0:.0f} s in all\n")
    print("| layout | loss gap vs 1 process | step ms (slowest rank, median) | step ms per rank | tokens/s | "
          "peak MiB per rank | shard MiB per rank (params+grads+optimizer) | counted per step, rank 0 (kind count "
          "MiB) | PP bubble, last rank: measured (analytic (p-1)/(vm+p-1)) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(row(r))
    notes = dict.fromkeys(n for r in runs for n in r.notes)
    print("\nMemory: " + "; ".join(sorted({m["peak_source"] for r in runs for m in r.memory})) + ".")
    print("Notes:\n" + "\n".join(f"- {n}" for n in notes))


if __name__ == "__main__":
    main()
