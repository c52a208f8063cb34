"""Benchmark: the workbook's tuned job against the configurations an expert would try by hand. Not a test.

    python benchmarks/bench_tuned.py [--tuned outputs/default/tuned.yaml] [--job parameters/default.yaml]
                                     [--full] [--rounds 4] [--steps 4]

The tuned job is the one ``mfu-lab run`` wrote (run the workbook on the job first). The hand-picked grid is
dtype (float32, bfloat16) x compile (off, default) x micro_batch (the job's, twice the job's), and with
``--full`` also x attention (sdpa, unfused). Every configuration runs in its own warm process
(mfu_lab.workers.verify_rung, as the verify step does) and all of them, the tuned job included, alternate
in interleaved rounds, so one run measures them side by side. Micro-batches differ, so configurations are
compared by tokens per second. Prints one row per configuration and the ratio of the tuned job's tokens/s to
the best hand-picked one (target: 0.95 or more). Writes benchmarks/last_tuned.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mfu_lab.analysis.precision import native_bf16  # noqa: E402
from mfu_lab.core.job.schema import load_job, validate  # noqa: E402
from mfu_lab.core.measure.sidebyside import interleave  # noqa: E402
from mfu_lab.workers.verify_rung import RungProcess  # noqa: E402


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's name and its native-bf16 flags (read the same way as step 5's precision ladder)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")),
                platform.processor())
    return name, native_bf16(text)["flags"]


def grid(job, full: bool) -> dict[str, dict]:
    axes = [("float32", "bfloat16"), ("off", "default"), (job.micro_batch, job.micro_batch * 2)]
    if full:
        axes.append(("sdpa", "unfused"))
    out = {}
    for combo in itertools.product(*axes):
        dtype, comp, mb = combo[:3]
        att = combo[3] if full else job.attention
        short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
        name = f"{short}/{'compile' if comp != 'off' else 'eager'}/mb{mb}" + (f"/{att}" if full else "")
        out[name] = job.to_dict() | {"dtype": dtype, "compile_mode": comp, "micro_batch": mb, "attention": att}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default=str(ROOT / "parameters" / "default.yaml"))
    ap.add_argument("--tuned", default=None, help="tuned job file (default: <job's output folder>/tuned.yaml)")
    ap.add_argument("--full", action="store_true", help="also vary the attention implementation")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()
    job = load_job(args.job)
    tuned_path = Path(args.tuned) if args.tuned else job.output_root() / "tuned.yaml"
    if not tuned_path.is_file():
        print(f"no tuned job at {tuned_path}: run `mfu-lab run {args.job}` first", file=sys.stderr)
        return 2
    tuned = load_job(tuned_path)
    configs = {"TUNED": tuned.to_dict()} | grid(job, args.full)
    for name, values in configs.items():  # the same warm-up and length for all, whatever the files say
        configs[name] = validate(values | {"verify_warmup_steps": max(3, job.verify_warmup_steps)}, name).to_dict()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="bench_tuned_"))
    procs: dict[str, RungProcess] = {}
    ready: dict[str, dict] = {}
    try:
        for i, (name, values) in enumerate(configs.items(), 1):
            print(f"[{i}/{len(configs)}] warming up {name}", flush=True)
            safe = name.replace("/", "_")
            p = RungProcess({"rung": safe, "job": values, "steps_total": args.rounds * args.steps}, work, 1800)
            procs[name] = p
            ready[name] = p.ready()
        done = interleave({n: p.run for n, p in procs.items()}, args.rounds, args.steps, print)
    finally:
        for p in procs.values():
            p.close()
    rows = []
    for name, values in configs.items():
        s = done.series[name]
        med = statistics.median(s.wall_s)
        rows.append({"config": name, "micro_batch": values["micro_batch"], "step_median_s": med,
                     "step_p10_s": sorted(s.wall_s)[len(s.wall_s) // 10], "tokens_per_s":
                     values["micro_batch"] * values["seq_len"] / med, "warmup_s": ready[name]["warmup_s"]})
    best = max((r for r in rows if r["config"] != "TUNED"), key=lambda r: r["tokens_per_s"])
    tuned_row = rows[0]
    ratio = tuned_row["tokens_per_s"] / best["tokens_per_s"]
    name, flags = cpu_model()
    print(f"\nCPU: {name}; native bf16 flags: {', '.join(flags) or 'none'}")
    print(f"tuned job: {tuned_path} (dtype {tuned.dtype}, compile_mode {tuned.compile_mode}, attention "
          f"{tuned.attention}, micro_batch {tuned.micro_batch})")
    print(f"{'configuration':<28}{'step ms':>10}{'tokens/s':>12}{'warm-up s':>11}")
    for r in sorted(rows, key=lambda r: -r["tokens_per_s"]):
        print(f"{r['config']:<28}{r['step_median_s'] * 1e3:>10.1f}{r['tokens_per_s']:>12.0f}{r['warmup_s']:>11.1f}")
    print(f"\ntuned / best hand-picked ({best['config']}): {ratio:.3f} in tokens/s (target >= 0.95); "
          f"{args.rounds} interleaved rounds x {args.steps} steps; {time.perf_counter() - t0:.0f} s in all")
    out = {"cpu": name, "bf16_flags": flags, "tuned_file": str(tuned_path), "rows": rows, "best": best["config"],
           "ratio": ratio, "order": done.order}
    (ROOT / "benchmarks" / "last_tuned.json").write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
