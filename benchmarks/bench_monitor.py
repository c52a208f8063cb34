"""Benchmark: what the production monitor (mfu_lab.monitor.Monitor) costs a training loop. Not a test.

    python benchmarks/bench_monitor.py [--rounds 8] [--steps 100] [--every 50] [--profile-every-s 1800]
                                       [--with-profile S] [--device auto|cpu|cuda] [--json PATH]

The cost is measured, never assumed. One training loop (the reference GPT of mfu_lab.core.engine.workload, cut down
so a step takes ~25 ms on a 2-core CPU: 2 layers, 4 heads, d_model 128, seq_len 128, micro_batch 4, vocab
2048, float32, eager, AdamW) runs with and without the monitor, the two alternating in interleaved rounds
(mfu_lab.core.measure.sidebyside.interleave: A B, A B, ...): the same model and optimiser, the same pre-built
batches every round, the same seed. Without the monitor the loop is ``for x, y in batches: step(x, y)``;
with it, ``for x, y in mon.loader(batches): step(x, y); mon.step(tokens=...)``, as a user writes it. Each
step is timed from the end of the previous one (the loader's ``next()`` and ``mon.step()`` included).

One monitor per arm stays open for the whole run, as in a real job, and the costs it pays once are taken
in an untimed warm-up through it and reported apart, in seconds: ``start()``, the first step, the second (run
under the FLOP counter, since only the model is given) and the first profiler window: its steps in the loop, and
what the steps beside its analysis pay (the analysis runs in a child process, off the loop, but on a CPU
it shares the cores with the job while it runs). Note that the first window
is not 1800 s away at the defaults: ``profile_every_s`` counts from ``start()``, so the first window opens at
the first interval boundary (after step ``every`` + 2) and the next ones ``profile_every_s`` later. After the
warm-up, the default monitor takes no further window during the benchmark, so the timed rounds measure its
steady state: three clock readings per step and one interval record every ``every`` steps.

Printed: the device and threads, torch's version, the median step with and without the monitor, and the
overhead (median with / median without - 1) with a 95% percentile-bootstrap interval over the steps
(mfu_lab.core.measure.sidebyside.bootstrap_speedup); a median cannot see a cost paid once in ``every`` steps, so the
amortised overhead (total time of the rounds with / without - 1, rounds resampled in their pairs) is given
too. Each is held to the target (under 1% of the step): PASS when the interval lies below 1%, FAIL when it
lies above, otherwise "not separable from 1% at this noise". Also printed: the monitor's own cost per step
isolated around a no-op step (best of 5 x 5000 steps, so machine noise cannot hide it), against the bare
step. ``--with-profile S`` adds a third arm, a monitor with a profiler window every S seconds, and prints
its amortised overhead, its windows in the timed rounds and the measured cost of one window.

The peak FLOP/s is measured once here (CPU: mfu_lab.core.measure.device's 1.5 s matmul rate) and passed to every
monitor as ``peak_flops``, so no monitor measures it again; on a GPU the monitor's datasheet row is used
(nothing measured). The monitors write into a temporary folder, deleted at the end. On CUDA the model and the
batches live on the GPU and ``torch.cuda.synchronize()`` runs only at the round boundaries, so the per-step
times are host times (what the monitor's clocks see) and the round totals are exact; the monitor's NVML
sampling thread (1 Hz) runs through both arms' rounds, so its cost is not in the difference.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step  # noqa: E402
from mfu_lab.core.job.schema import load_job  # noqa: E402
from mfu_lab.core.measure.device import DeviceInfo, cpu_name, resolve_peak  # noqa: E402
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave  # noqa: E402
from mfu_lab.core.measure.timed import percentile  # noqa: E402
from mfu_lab.core.store.monitor_files import record_path  # noqa: E402
from mfu_lab.monitor import Monitor  # noqa: E402

TARGET = 0.01  # the monitor's cost: under 1% of the step
WORKLOAD = {"n_layers": 2, "n_heads": 4, "d_model": 128, "seq_len": 128, "micro_batch": 4, "vocab_size": 2048,
            "dtype": "float32", "compile_mode": "off", "num_workers": 0, "seed": 0}


def verdict(low: float, high: float) -> str:
    """PASS / FAIL / not separable, for an overhead interval (fractions) against the target."""
    if low > TARGET:
        return "FAIL"
    if high < TARGET:
        return "PASS"
    return f"not separable from {TARGET:.0%} at this noise"


def paired_ratio(with_s: list[float], bare_s: list[float], samples: int = 2000, seed: int = 0) -> dict:
    """sum(with) / sum(bare) over the rounds, with a percentile-bootstrap interval: rounds resampled in their
    (with, bare) pairs, since both ran side by side in the same round."""
    rng = random.Random(seed)
    idx = range(len(with_s))
    ratios = []
    for _ in range(samples):
        pick = rng.choices(idx, k=len(with_s))
        ratios.append(sum(with_s[i] for i in pick) / sum(bare_s[i] for i in pick))
    return {"ratio": sum(with_s) / sum(bare_s), "low": percentile(ratios, 2.5), "high": percentile(ratios, 97.5)}


def records(mon: Monitor, kind: str) -> list[dict]:
    path = record_path(mon.out_dir, mon.host, mon.ids["rank"], mon.run)
    if not path.is_file():
        return []
    return [r for line in path.read_text().splitlines() if line and (r := json.loads(line))["kind"] == kind]


class Loop:
    """The training loop, with or without a monitor; every call runs ``n`` steps over the same batches."""

    def __init__(self, step, batches: list, tokens: int, cuda: bool, mon: Monitor | None = None):
        self.step, self.batches, self.tokens, self.cuda, self.mon = step, batches, tokens, cuda, mon
        self.round_s: list[float] = []

    def __call__(self, n: int) -> dict[str, list[float]]:
        batches = self.batches[:n]
        if self.cuda:  # pragma: no cover - GPU only
            torch.cuda.synchronize()  # the other arm's queued work is not this round's
        walls = []
        start = t = time.perf_counter()
        if self.mon is None:
            for x, y in batches:
                self.step(x, y)
                now = time.perf_counter()
                walls.append(now - t)
                t = now
        else:
            mon = self.mon
            for x, y in mon.loader(batches):
                self.step(x, y)
                mon.step(tokens=self.tokens)
                now = time.perf_counter()
                walls.append(now - t)
                t = now
        if self.cuda:  # pragma: no cover - GPU only
            torch.cuda.synchronize()
        self.round_s.append(time.perf_counter() - start)
        return {"wall_s": walls}


def profiled_windows(mon) -> int:
    """Windows whose steps ran so far, from the interval records' profiled steps: a window's own record waits for
    its analysis, which may still be running in its child."""
    return round(sum(r["profiled_steps"] for r in records(mon, "interval")) / mon.profile_steps)


def warm_up(mon: Monitor, loop: Loop, every: int, stack: contextlib.ExitStack, tail: int = 100) -> dict:
    """Open the monitor (``with``, through ``stack``) and take it through its one-off costs, untimed by the
    rounds: start(), the warm-up step and the FLOP-counted second step, the first profiler window (opened at the
    interval boundary, step every + 2) and the steps that run while its analysis runs in the background. Returns
    what each cost the loop, in seconds, over the median of the ordinary steps (3 to every + 1, and those after
    the window's analysis)."""
    t0 = time.perf_counter()
    stack.enter_context(mon)
    start_s = time.perf_counter() - t0
    k = mon.profile_steps  # the profiled steps; the last one stops the profiler and hands off the analysis
    w0 = every + 2  # walls[w0] is the first profiled step (the window opens at the end of step every + 2)
    n = w0 + k + tail + 20
    walls: list[float] = []
    while len(walls) < n:
        walls += loop(min(n - len(walls), len(loop.batches)))["wall_s"]
    loop.round_s.clear()
    deadline = time.monotonic() + 300  # the window's record is written once its analysis (a child) answers
    while not records(mon, "profile") and time.monotonic() < deadline:
        time.sleep(0.5)
    win = records(mon, "profile")
    ref_early = statistics.median(walls[2:every])
    analysis_s = win[0].get("analysis_s") if win else None
    paid = min(tail, math.ceil(analysis_s / ref_early) + 5) if analysis_s else 0  # steps beside the analysis
    ref = statistics.median(walls[2:every] + walls[w0 + k + paid:])
    return {"start_s": start_s, "first_step_extra_s": walls[0] - ref, "counted_step_extra_s": walls[1] - ref,
            "first_window_at_step": every + 3 if win else None,
            "first_window_extra_s": sum(walls[w0:w0 + k]) - k * ref if win else None,
            "first_window_overhead_s": win[0].get("overhead_s") if win else None,
            "first_window_analysis_s": analysis_s,
            "analysis_paid_by_loop_s": sum(walls[w0 + k:w0 + k + paid]) - paid * ref if win else None,
            "analysis_steps": paid}


def isolated_cost(folder: Path, every: int, n: int = 5000, repeats: int = 5) -> float:
    """Seconds per step the monitor adds around a no-op step (loader wrapper, step(), an interval record
    every ``every`` steps), best of ``repeats``: the steady state, between profiler windows."""
    items = [None] * n
    best_bare = best_mon = float("inf")
    for r in range(repeats):
        t0 = time.perf_counter()
        for _ in iter(items):
            pass
        best_bare = min(best_bare, time.perf_counter() - t0)
        mon = Monitor(folder / f"noop{r}", every=every, profile_every_s=None).start()
        try:
            mon.step(tokens=1)  # the first step is the monitor's warm-up: not timed, here either
            t0 = time.perf_counter()
            for _ in mon.loader(items):
                mon.step(tokens=1)
            best_mon = min(best_mon, time.perf_counter() - t0)
        finally:
            mon.close()
    return max(best_mon - best_bare, 0.0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--rounds", type=int, default=8, help="interleaved rounds (default 8)")
    ap.add_argument("--steps", type=int, default=100, help="steps per arm per round (default 100)")
    ap.add_argument("--every", type=int, default=50, help="the monitor's interval, in steps (default 50)")
    ap.add_argument("--profile-every-s", type=float, default=1800.0,
                    help="the monitor's profiler period, seconds (default 1800, the monitor's own)")
    ap.add_argument("--with-profile", type=float, default=None, metavar="S",
                    help="also time a monitor with a profiler window every S seconds (e.g. 5)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures to PATH")
    args = ap.parse_args()
    if args.rounds < 2 or args.steps < 2:
        ap.error("--rounds and --steps must be at least 2")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    t_all = time.perf_counter()
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else cpu_name()

    job = load_job(ROOT / "parameters" / "default.yaml", WORKLOAD | {"device": device.type})
    model = build_model(job).to(device)  # seeded by job.seed
    step = build_train_step(job, model, device.type)
    batches = [(x.to(device), y.to(device)) for x, y in build_loader(job, args.steps, "cpu")]
    tokens = job.micro_batch * job.seq_len
    peak = None if cuda else resolve_peak(DeviceInfo("cpu", name, None, None, torch.get_num_threads()),
                                          "float32", None).flops_per_s

    print(f"mfu-lab monitor overhead: {name}, torch {torch.__version__}, {torch.get_num_threads()} threads"
          + (f", CUDA {torch.version.cuda}" if cuda else ""))
    print(f"workload: reference GPT {job.n_layers} layers x d_model {job.d_model}, seq_len {job.seq_len}, "
          f"micro_batch {job.micro_batch}, {job.dtype}, eager, AdamW; {args.rounds} interleaved rounds x "
          f"{args.steps} steps per arm; monitor every={args.every}, profile_every_s={args.profile_every_s:g}; peak "
          + (f"{peak / 1e9:.1f} GFLOP/s measured once and passed as peak_flops" if peak else "from the datasheet"))

    report: dict = {"device": name, "device_type": device.type, "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "workload": WORKLOAD, "rounds": args.rounds,
                    "steps": args.steps, "every": args.every, "profile_every_s": args.profile_every_s,
                    "peak_flops": peak, "target": TARGET}
    bare = Loop(step, batches, tokens, cuda)
    bare(min(10, args.steps))  # warm-up of allocator and kernels, discarded
    bare.round_s.clear()

    with tempfile.TemporaryDirectory(prefix="bench_monitor_") as tmp, contextlib.ExitStack() as stack:
        arms = {"without": bare}
        mon = Monitor(Path(tmp) / "default", model=model, every=args.every, peak_flops=peak,
                      profile_every_s=args.profile_every_s)
        arms["with"] = Loop(step, batches, tokens, cuda, mon)
        prof = None
        if args.with_profile:
            prof = Monitor(Path(tmp) / "profiled", model=model, every=args.every, peak_flops=peak,
                           profile_every_s=args.with_profile)
            arms["with_profile"] = Loop(step, batches, tokens, cuda, prof)
        print("\nwarm-up through the monitor (one-off costs, not in the rounds)", flush=True)
        report["one_off"] = one = warm_up(mon, arms["with"], args.every, stack)
        prof_windows_before = 0
        if prof is not None:
            warm_up(prof, arms["with_profile"], args.every, stack)
            prof_windows_before = profiled_windows(prof)
        print(f"  start() {one['start_s'] * 1e3:.1f} ms; first step +{one['first_step_extra_s'] * 1e3:.1f} ms; "
              f"second step, under the FLOP counter, +{one['counted_step_extra_s'] * 1e3:.1f} ms", end="")
        if one["first_window_at_step"]:
            print(f"; first profiler window at step {one['first_window_at_step']} (profile_every_s counts from "
                  f"start): its {mon.profile_steps} steps +{one['first_window_extra_s']:.2f} s in the loop "
                  f"(profiler stop, trace export and the child's start {one['first_window_overhead_s']:.2f} s of it); "
                  "its analysis ran "
                  f"{one['first_window_analysis_s']:.2f} s in a child process, and the {one['analysis_steps']} "
                  f"steps beside it paid {one['analysis_paid_by_loop_s']:+.2f} s")
        else:
            print("; no profiler window")
        windows_before = len(records(mon, "profile"))

        print(f"\n{args.rounds} interleaved rounds", flush=True)
        done = interleave(arms, args.rounds, args.steps, lambda s: print("  " + s, flush=True))
        report["order"] = done.order
        windows_timed = len(records(mon, "profile")) - windows_before
        prof_windows = profiled_windows(prof) - prof_windows_before if prof is not None else 0
        report["isolated_s_per_step"] = iso = isolated_cost(Path(tmp), args.every)

    w, b = done.series["with"].wall_s, done.series["without"].wall_s
    med_w, med_b = statistics.median(w), statistics.median(b)
    sp = bootstrap_speedup(w, b)  # median(with) / median(without), both samples resampled
    med = {"ratio": sp.value, "low": sp.low, "high": sp.high}
    amort = paired_ratio(arms["with"].round_s, bare.round_s)
    rows = [("median step", med), ("amortised (round totals)", amort)]
    report |= {"step_median_with_s": med_w, "step_median_without_s": med_b, "median": med, "amortised": amort,
               "windows_in_timed_rounds": windows_timed}
    if prof is not None:
        pa = paired_ratio(arms["with_profile"].round_s, bare.round_s)
        per_window = (sum(arms["with_profile"].round_s) - sum(bare.round_s)) / prof_windows if prof_windows else None
        rows.append((f"amortised, window/{args.with_profile:g}s", pa))
        report["with_profile"] = {"every_s": args.with_profile, "windows": prof_windows, "window_cost_s": per_window,
                                  "step_median_s": statistics.median(done.series["with_profile"].wall_s), **pa}

    print(f"\nstep median: without {med_b * 1e3:.2f} ms, with the monitor {med_w * 1e3:.2f} ms "
          f"({len(b)} steps each)")
    print(f"{'overhead':<32}{'ratio - 1':>11}{'95% interval':>22}   target < {TARGET:.0%}")
    verdicts = []
    for label, r in rows:
        v = verdict(r["low"] - 1, r["high"] - 1)
        verdicts.append(v)
        r["verdict"] = v
        print(f"{label:<32}{r['ratio'] - 1:>+11.2%}   [{r['low'] - 1:+.2%}, {r['high'] - 1:+.2%}]   {v}")
    iso_ratio = iso / med_b
    report["isolated_ratio"] = iso_ratio
    print(f"isolated: the monitor adds {iso * 1e6:.1f} us per step around a no-op step (an interval record every "
          f"{args.every} steps included) = {iso_ratio:.3%} of the bare step  "
          f"{'PASS' if iso_ratio < TARGET else 'FAIL'}")
    print(f"profiler windows in the timed rounds: {windows_timed} (profile_every_s={args.profile_every_s:g})")
    if prof is not None:
        p = report["with_profile"]
        cost = f"{p['window_cost_s']:.2f} s" if p["window_cost_s"] is not None else "n/a"
        bounds = args.rounds * args.steps // args.every
        print(f"with a window every {args.with_profile:g} s: {prof_windows} windows at its {bounds} interval "
              f"boundaries in the timed rounds (the clock runs on wall time, the other arms' rounds included), "
              f"each costing {cost} over the bare loop."
              + (f" At one window per {args.profile_every_s:g} s that cost is "
                 f"{p['window_cost_s'] / args.profile_every_s:.3%} of wall time." if p["window_cost_s"] else ""))
    report["seconds"] = time.perf_counter() - t_all
    print(f"\n{report['seconds']:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"figures written to {args.json}")
    return 1 if "FAIL" in verdicts[:2] else 0  # the defaults; a --with-profile window period is a demonstration


if __name__ == "__main__":
    sys.exit(main())
