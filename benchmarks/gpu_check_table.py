"""The GPU check's plain parts, testable on a CPU: the ``--steps`` selection, the world-size and time guards, and
the table of what each GPU path measured (one row per path, written as markdown and JSON).

No torch import here: ``tests/test_gpu_check.py`` reads all of it on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The steps in the order they run (later ones read earlier ones' results), and their table names.
STEPS = ("monitor", "baseline", "race1", "attention_comm", "kernels", "compile", "fp8", "placement", "verify",
         "layouts")
# "layouts" (the job in its own layout: FSDP2 over NCCL...) is a call of its own: --steps layouts
DEFAULT_STEPS = tuple(s for s in STEPS if s != "layouts")
# The check in parts, each one 10-minute call, the riskiest paths first: NCCL launches, step 2's race and its
# confirmation and step 3's per-rank traces; then compile, FP8, placement and step 7 (which read part 1's results
# from the same --out); then the layouts.
PARTS = {1: ("monitor", "baseline", "race1", "attention_comm", "kernels"),
         2: ("compile", "fp8", "placement", "verify"), 3: ("layouts",)}
PATHS = {"monitor": "monitor", "baseline": "step 1", "race1": "step 2 (world 1)", "attention_comm": "step 2",
         "kernels": "step 3",
         "compile": "step 4", "fp8": "step 5", "placement": "step 6", "verify": "step 7", "layouts": "layouts"}
# Rough seconds of each step on one H200 with the check's small job (gpu_check.SMALL_JOB), process start-ups and
# compiles included; DDP_EXTRA_S is added where a step launches torchrun (2+ ranks). Guesses to be corrected by
# the first runs: each step's actual seconds are printed beside its estimate.
ESTIMATE_S = {"monitor": 20.0, "baseline": 20.0, "race1": 60.0, "attention_comm": 30.0, "kernels": 25.0,
              "compile": 110.0, "fp8": 115.0, "placement": 45.0, "verify": 200.0, "layouts": 150.0}
# step 7: 120 s of rungs, plus its compiled rungs' cold compiles (~40 s each for two: the rungs do not share the
# compile trials' inductor cache)
DDP_EXTRA_S = {"attention_comm": 35.0, "kernels": 30.0, "verify": 25.0, "layouts": 120.0}
PACE_RANGE = (0.75, 3.0)  # how far the steps run so far may scale the next estimate (never below 3/4 of it)
MAX_VISIBLE = 8  # more GPUs than this: the check caps its ranks (two suffice to exercise NCCL)
CHECK_RANKS = 2
COLUMNS = ("path", "figure", "value", "label", "pass/fail")


class StepsError(ValueError):
    """A ``--steps`` value that names no step; the message names the allowed values and the nearest one."""


def parse_steps(text: str) -> list[str]:
    """``monitor,baseline,...`` -> the steps in run order, each once; ``all`` for every step."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if not names:
        raise StepsError(f"--steps is empty; allowed: {', '.join(STEPS)} (or all)")
    if "all" in names:
        return list(STEPS)
    for n in names:
        if n not in STEPS:
            near = difflib.get_close_matches(n, STEPS, n=1)
            hint = f" (did you mean '{near[0]}'?)" if near else ""
            raise StepsError(f"unknown step '{n}'{hint}; allowed: {', '.join(STEPS)} (or all), comma-separated")
    return [s for s in STEPS if s in names]


def world_guard(visible: int, requested: int) -> tuple[int, str]:
    """(nproc_per_node for the check, what was done): the job's ``requested`` (0: one per visible GPU), capped at
    min(visible, 2) when more than 8 GPUs are visible or more ranks are asked for than GPUs are visible."""
    if visible < 1:
        raise ValueError("no GPU visible: nothing to launch")
    want = requested or visible
    if visible > MAX_VISIBLE or want > visible:
        chosen = min(visible, CHECK_RANKS)
        why = f"{visible} GPUs visible" if visible > MAX_VISIBLE else f"{want} ranks asked for, {visible} GPUs visible"
        return chosen, (f"world-size guard: nproc_per_node capped at {chosen} for the check ({why}; two ranks "
                        "suffice to exercise NCCL)")
    how = "the job's" if requested else "one per visible GPU"
    return want, f"nproc_per_node {want} ({how})"


def estimate_s(step: str, world: int) -> float:
    """Rough seconds of ``step`` with ``world`` ranks (DDP launches only with 2+)."""
    return ESTIMATE_S[step] + (DDP_EXTRA_S.get(step, 0.0) if world >= 2 else 0.0)


def pace(estimated: list[float], actual: list[float]) -> float:
    """How much slower (or faster) the steps so far ran than estimated, clamped to PACE_RANGE; 1 before any."""
    if not estimated or sum(estimated) <= 0:
        return 1.0
    return min(PACE_RANGE[1], max(PACE_RANGE[0], sum(actual) / sum(estimated)))


def time_guard(elapsed_s: float, limit_s: float, estimate: float) -> str:
    """'' when a step of ``estimate`` seconds ends inside ``limit_s``; else why not (the skip's reason)."""
    left = limit_s - elapsed_s
    if estimate <= left:
        return ""
    return f"time: ~{estimate:.0f} s needed, {max(0.0, left):.0f} s left of --limit-s {limit_s:.0f}"


# ---------------------------------------------------------------------- the table
@dataclass
class Row:
    path: str  # monitor | step 1 ... step 7
    figure: str  # what was checked
    value: str  # the figure as text, or why there is none
    label: str  # measured | counted | datasheet | emulated | modelled | -
    status: str  # pass | fail | skip: <reason>


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def figure_row(path: str, figure: str, x: Any, fmt: str = "{}", note: str = "", label: str = "measured",
               ok: bool = True) -> Row:
    """A row that passes when ``x`` is a finite number (and ``ok``). The value is ``fmt.format(x)`` (``fmt`` is
    fixed text: figures from the results go in ``note``, never through ``format``) and then ``note``."""
    value = fmt.format(x) if finite(x) else f"missing ({x!r})"
    return Row(path, figure, f"{value} {note}".strip(), label, "pass" if finite(x) and ok else "fail")


def skip_row(path: str, figure: str, reason: str, value: str = "-") -> Row:
    return Row(path, figure, value, "-", f"skip: {first_line(reason)}")


def fp8_speed_row(path: str, figure: str, speed: dict[str, Any], capability: tuple[int, ...]) -> Row:
    """Step 5's torchao float8 speed (``FP8Result.speed``): the whole model's speed-up when it was timed; a pass
    that lists the per-group probe's figures when the probe found no group faster (``slower``: the step did what
    it should, measured); a skip with the step's reason; a failure otherwise."""
    status = speed.get("status")
    if tuple(capability) < (8, 9):
        return skip_row(path, figure, "SM < 8.9", f"capability {tuple(capability)}")
    if status == "ok":
        return figure_row(path, figure, speed.get("speedup"), "{:.2f}x bf16",
                          f"({(speed.get('bf16_step_s') or 0) * 1e3:.2f} -> "
                          f"{(speed.get('fp8_step_s') or 0) * 1e3:.2f} ms/step, compiled)")
    if status == "slower":  # the per-group probe ran (CUDA events) and dropped every group: a measured outcome
        probe = [r for r in speed.get("group_probe", []) if finite(r.get("speedup"))]
        figs = ", ".join(f"{r['group']} {r['in']}x{r['out']} {r['speedup']:.2f}x" for r in probe)
        return Row(path, figure, f"no group faster than bf16, not adopted ({figs or 'no probe figures'})",
                   "measured", "pass" if probe else "fail")
    if status == "skipped":
        return skip_row(path, figure, speed.get("reason", ""))
    return fail_row(path, figure, str(speed.get("reason", speed)))


def fp8_applied_row(path: str, figure: str, fp8: dict[str, Any], step_s: Any, capability: tuple[int, ...]) -> Row:
    """Step 1 on the job with ``fp8_layers`` (``BaselineResult.fp8``, core.engine.fp8): passes when the groups'
    Linear layers trained in FP8 and the step was timed; a skip where the device has no FP8 units (as step 1 says
    why); a failure when it should have converted and did not."""
    if tuple(capability) < (8, 9):
        return skip_row(path, figure, fp8.get("why_not") or "SM < 8.9", f"capability {tuple(capability)}")
    if fp8.get("why_not") or not fp8.get("layers"):
        return fail_row(path, figure, fp8.get("why_not") or f"no layer converted ({fp8})")
    return figure_row(path, figure, ms(step_s), "{:.1f} ms/step",
                      f"with {len(fp8['layers'])} Linear layer(s) in FP8 ({', '.join(fp8['groups'])}, recipe "
                      f"{fp8.get('recipe')})")


def fail_row(path: str, figure: str, err: BaseException | str) -> Row:
    text = err if isinstance(err, str) else f"{type(err).__name__}: {err}"
    return Row(path, figure, first_line(text), "-", "fail")


def first_line(text: str, width: int = 160) -> str:
    line = next((ln.strip() for ln in str(text).splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[:width - 3] + "..."


def _cells(r: Row) -> list[str]:
    return [str(getattr(r, f.name)).replace("\n", " ") for f in dataclasses.fields(Row)]


def format_table(rows: list[Row]) -> str:
    """The rows as aligned plain text, for the terminal."""
    body = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(COLUMNS))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in body]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    n = {k: sum(r.status.startswith(k) for r in rows) for k in ("pass", "fail", "skip")}
    return f"{n['pass']} pass, {n['fail']} fail, {n['skip']} skipped"


def markdown(rows: list[Row], header: dict[str, Any]) -> str:
    """The header as a list and the rows as a markdown table (``|`` in a cell escaped)."""
    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    out = ["# GPU check", ""] + [f"- {k}: {esc(str(v))}" for k, v in header.items()] + [""]
    out += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(esc(c) for c in _cells(r)) + " |" for r in rows]
    return "\n".join(out + ["", summary(rows), ""])


def write_table(rows: list[Row], header: dict[str, Any], folder: Path) -> tuple[Path, Path]:
    """``<folder>/table.md`` and ``<folder>/table.json``; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    md, js = folder / "table.md", folder / "table.json"
    md.write_text(markdown(rows, header))
    js.write_text(json.dumps({"header": header, "rows": [dataclasses.asdict(r) for r in rows],
                              "summary": summary(rows)}, indent=1, default=str) + "\n")
    return md, js


# ---------------------------------------------------------------------- reading the steps' results
@dataclass
class Ctx:
    """What every step of the check is given: the small job, the GPUs visible, the ranks, the capability."""

    job: Any
    visible: int
    world: int
    capability: tuple[int, int]
    out: Path


def add(rows: list[Row], path: str, figure: str, make: Callable[[], Row]) -> None:
    """One table row from ``make()``; an error while reading the result is that row's failure."""
    try:
        rows.append(make())
    except Exception as e:  # noqa: BLE001 - a wrong attribute is the check's finding, not a crash
        rows.append(fail_row(path, figure, e))


def ms(x: Any) -> Any:
    return x * 1e3 if finite(x) else x


def one_gpu(ctx: Ctx, path: str, figure: str) -> Row | None:
    """The skip row of a DDP path in a world of one rank (by design with one GPU), else None."""
    if ctx.world < 2:
        return skip_row(path, figure, "one GPU" if ctx.visible == 1 else f"world {ctx.world}")
    return None
