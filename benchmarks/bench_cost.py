"""The workbook's own cost: the default job run with racing sweeps (the default) and with --thorough, side by side.

    python benchmarks/bench_cost.py [--job parameters/default.yaml] [--out /tmp/bench-cost] [--budget MIN]
                                    [--racing-only]

Runs ``mfu-lab run JOB`` twice, in fresh processes, one after the other on this machine: first racing, then
``--thorough`` (exhaustive sweeps). Prints each step's wall time (from the runner's own "done in" lines, notebook
start-up included), the whole run's wall time, and for every step that chooses something whether both runs chose
the same, or the racing choice's measured step time lies inside the thorough choice's p10-p90. Not a test: the
times move with the machine; the ratio is measured side by side in one invocation. Writes <out>/bench_cost.json.

Each run's cost is also given in units of the job's own training step: its seconds over step 1's median step
time in the same run (``step_time_median_s``). Seconds differ by machine; that count of training steps compares
across machines (a CPU twice as slow takes about twice as long for both).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DONE = re.compile(r"^\[\d+/\d+\] (\d\d_\w+) (?:done in (\d+) s|FAILED)")


def run(job: str, out: Path, extra: list[str]) -> dict:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "mfu_lab", "run", job, "--out", str(out), "-q", *extra], cwd=ROOT,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    steps = {}
    for line in p.stdout.splitlines():
        m = DONE.match(line)
        if m:
            steps[m.group(1)] = float(m.group(2)) if m.group(2) else None
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-3000:], sep="\n", file=sys.stderr)
    return {"wall_s": wall, "steps": steps, "returncode": p.returncode}


def _load(root: Path, folder: str) -> dict | None:
    f = root / folder / "result.json"
    return json.loads(f.read_text()) if f.is_file() else None


def step_units(root: Path) -> float | None:
    """Step 1's median step time in the run under ``root`` (the unit of the cost in training steps), or None."""
    b = _load(root, "01_baseline")
    v = ((b or {}).get("metrics", {}).get("step_time_median_s") or {}).get("value")
    return float(v) if isinstance(v, (int, float)) and v > 0 else None


def in_steps(seconds: float | None, unit: float | None) -> str:
    return f"{seconds / unit:,.0f}" if seconds is not None and unit else "-"


def _within(value: float | None, row: dict | None) -> bool:
    return bool(value is not None and row and row.get("step_p10_s") is not None
                and row["step_p10_s"] <= value <= row["step_p90_s"])


def agreement(fast: Path, slow: Path) -> dict[str, str]:
    """Per step that chooses: 'same', 'within p10-p90 (...)', or 'DIFFERENT (...)'."""
    out = {}
    a, b = _load(fast, "02_attention_and_comm"), _load(slow, "02_attention_and_comm")
    if a and b:
        ra, rb = a["recommendation"].get("attention"), b["recommendation"].get("attention")
        rows = {r["name"]: r for r in b["attention"]}
        mine = next((r for r in a["attention"] if r["name"] == ra), {})
        out["02 attention"] = "same" if ra == rb else (
            f"within p10-p90 ({ra} vs {rb})" if _within(mine.get("step_median_s"), rows.get(rb)) else
            f"DIFFERENT ({ra} vs {rb})")
        ca, cb = a["recommendation"].get("comm"), b["recommendation"].get("comm")

        def key(c):
            return (c["hook"], float(c["bucket_cap_mb"]), c["gradient_as_bucket_view"]) if c else None

        rows = {(r["hook"], float(r["bucket_mb"]), r["grad_as_bucket_view"]): r for r in b["comm"]}
        mine = next((r for r in a["comm"] if key(ca) == (r["hook"], float(r["bucket_mb"]), r["grad_as_bucket_view"])),
                    {})
        out["02 DDP"] = "same" if key(ca) == key(cb) else (
            f"within p10-p90 ({key(ca)} vs {key(cb)})" if _within(mine.get("step_median_s"), rows.get(key(cb)))
            else f"DIFFERENT ({key(ca)} vs {key(cb)})")
    a, b = _load(fast, "04_compile"), _load(slow, "04_compile")
    if a and b:
        ma, mb = a["recommendation"].get("mode"), b["recommendation"].get("mode")
        rows = {t["mode"]: t for t in b["trials"]} | {"eager": b["eager"]}
        mine = next((t for t in a["trials"] + [a["eager"]] if t["mode"] == (ma or "eager")), {})
        out["04 compile"] = "same" if ma == mb else (
            f"within p10-p90 ({ma} vs {mb})" if _within(mine.get("step_median_s"), rows.get(mb or "eager"))
            else f"DIFFERENT ({ma} vs {mb})")
    a, b = _load(fast, "05_fp8"), _load(slow, "05_fp8")
    if a and b:
        pa, pb = a["precision"]["choice"].get("rung"), b["precision"]["choice"].get("rung")
        out["05 precision"] = "same" if pa == pb else f"DIFFERENT ({pa} vs {pb})"
        fa, fb = a["choice"].get("policy"), b["choice"].get("policy")
        out["05 FP8 policy"] = "same" if fa == fb else f"DIFFERENT ({fa} vs {fb})"
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default="parameters/default.yaml")
    ap.add_argument("--out", default="/tmp/bench-cost")
    ap.add_argument("--budget", type=float, help="also pass --budget MIN to the racing run")
    ap.add_argument("--racing-only", action="store_true", help="the default run alone, no --thorough run")
    args = ap.parse_args()
    out = Path(args.out)
    name = "default" if args.job.endswith("default.yaml") else Path(args.job).stem
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"bench_cost: {args.job} on {cpu}; racing first, then --thorough (each a fresh mfu-lab run)")
    extra = ["--budget", str(args.budget)] if args.budget is not None else []  # else the job file's budget_min
    fast = run(args.job, out / "racing", extra)
    print(f"  racing: {fast['wall_s']:.0f} s (exit {fast['returncode']})", flush=True)
    unit = step_units(out / "racing" / name)
    print(f"  step 1's median training step: {unit * 1e3:.1f} ms (the cost's unit)" if unit else
          "  step 1's median training step: not found (step 1 failed?)")
    if args.racing_only:
        print(f"\n{'step':<26}{'s':>8}{'training steps':>16}")
        for f, a in fast["steps"].items():
            print(f"{f:<26}{a if a is not None else 'failed':>8}{in_steps(a, unit):>16}")
        print(f"{'whole run':<26}{fast['wall_s']:>8.0f}{in_steps(fast['wall_s'], unit):>16}")
        (out / "bench_cost.json").write_text(json.dumps({"cpu": cpu, "racing": fast, "step_unit_s": unit},
                                                        indent=2))
        return 0
    slow = run(args.job, out / "thorough", ["--thorough", "--budget", "0"])  # every candidate, in full
    print(f"  thorough: {slow['wall_s']:.0f} s (exit {slow['returncode']})", flush=True)
    agree = agreement(out / "racing" / name, out / "thorough" / name)
    folders = list(dict.fromkeys([*fast["steps"], *slow["steps"]]))
    print(f"\n{'step':<26}{'racing s':>10}{'thorough s':>12}{'ratio':>8}{'racing, steps':>15}")
    for f in folders:
        a, b = fast["steps"].get(f), slow["steps"].get(f)
        ratio = f"{b / a:.2f}x" if a and b else "-"
        print(f"{f:<26}{a if a is not None else 'failed':>10}{b if b is not None else 'failed':>12}{ratio:>8}"
              f"{in_steps(a, unit):>15}")
    print(f"{'whole run':<26}{fast['wall_s']:>10.0f}{slow['wall_s']:>12.0f}{slow['wall_s'] / fast['wall_s']:>7.2f}x"
          f"{in_steps(fast['wall_s'], unit):>15}")
    print("\nchoices, racing against thorough:")
    for k, v in agree.items():
        print(f"  {k:<16} {v}")
    target = fast["wall_s"] <= 300 and slow["wall_s"] / fast["wall_s"] >= 2 and all(
        not v.startswith("DIFFERENT") for v in agree.values())
    print(f"\ntargets (whole racing run <= 300 s, >= 2x faster than thorough, every choice agreeing): "
          f"{'met' if target else 'NOT met'}")
    (out / "bench_cost.json").write_text(json.dumps({"cpu": cpu, "racing": fast, "thorough": slow,
                                                     "agreement": agree, "targets_met": target,
                                                     "step_unit_s": unit}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
