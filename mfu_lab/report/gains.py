"""Each recommendation's estimated gain: the share of the job's step time the change could give back, taken from
the figures the step that made the recommendation stored in its result, with their label and the step that
measured them. The index and the summary order recommendations by it (:func:`ordered`).

A recommendation is matched to its figure by the step that made it and the start of its message (the steps'
``advise`` functions write them), or, for a step's own recommendation text, by that text. Three kinds of figure:

- a measured speedup s of a change timed side by side: the gain is 1 - 1/s of the step (``estimate``);
- an estimate of the time a change saves (step 3's fusion candidates: bytes not moved at the measured
  bandwidth): that time over the profiled step (``estimate``, analytic);
- the share of the step the thing a change removes takes (data waits, idle gaps, the optimizer, exposed
  communication): the most the change could give back (``bound``, "up to").

A bound and an estimate on the same loss (step 3's "waiting for data" up to a share of its profiled step, step 1's
loader race measured side by side against the job's own loader) are not two gains: the bound ranks no higher than
the largest measured estimate on that loss (:func:`rank`), and still shows its own figure.

A recommendation no stored figure measures (placement on a cluster, a scheduler setting, the monitor's) has no
gain and is listed after those that have one; one that says to keep the job as it is has a gain of 0 and is listed
last. Pure functions of the steps' result dicts (``mfu_lab.core.store.files.load_results``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mfu_lab.core.registry import STEPS

SEVERITY_ORDER = {"act": 0, "look": 1, "info": 2}


@dataclass(frozen=True)
class Gain:
    """The share of the step time a change could give back, and where that figure comes from."""

    share: float  # of the step time, 0..1
    kind: str  # "estimate" | "bound" (the most it could give back) | "none" (keep as is: nothing to gain)
    source: str  # the figure's label: measured | analytic | emulated | modelled
    evidence: str  # which step measured what
    topic: str = ""  # the loss it addresses ("data"): a bound ranks no higher than a measured estimate of it

    def __post_init__(self) -> None:
        # "up to X%" is never measured: it is the most a change could give back, the share of the loss it
        # addresses (a formula over a measured figure, which the evidence names), so it is labelled analytic
        if self.kind == "bound" and self.source == "measured":
            object.__setattr__(self, "source", "analytic")

    @property
    def text(self) -> str:
        if self.kind == "none":
            return "nothing to gain: keep as is"
        return ("up to " if self.kind == "bound" else "about ") + f"{self.share:.1%} of the step"


def _value(result: dict, name: str) -> float | None:
    v = ((result.get("metrics") or {}).get(name) or {}).get("value")
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _source(result: dict, name: str, default: str = "measured") -> str:
    return str(((result.get("metrics") or {}).get(name) or {}).get("source") or default)


def _speedup(s: float | None, step: str, what: str, source: str = "measured") -> Gain | None:
    if s is None or s <= 0:
        return None
    if s <= 1.0:
        return Gain(0.0, "none", source, f"step {step}: {what} {s:.2f}x")
    return Gain(1.0 - 1.0 / s, "estimate", source, f"step {step}: {what} {s:.2f}x, so 1 - 1/{s:.2f} of the step")


def _share(result: dict, name: str, step: str, what: str) -> Gain | None:
    v = _value(result, name)
    return None if v is None else Gain(max(0.0, v), "bound", _source(result, name), f"step {step}: {what} {v:.1%}")


def _baseline(d: dict, msg: str) -> Gain | None:
    race = d.get("loader_race") or {}
    if msg.startswith("The device waits on data: load with") and race.get("adopted"):
        g = _speedup((race.get("speedup") or {}).get("value"), "1", f"loader race, {race.get('pick')} against the "
                     "job's own loader, side by side")
        return g and dataclasses.replace(g, topic="data")
    if msg.startswith("The device waits on data"):
        g = _share(d, "data_wait_fraction", "1", "data wait, share of wall time")
        return g and dataclasses.replace(g, topic="data")
    if msg.startswith("Host-side overhead"):
        return _share(d, "host_fraction", "1", "host time between steps, share of wall time")
    items = {i.get("name"): i for i in (d.get("ledger") or {}).get("items") or []}
    for prefix, name, what in (("Most of the peak is lost", "efficiency", "compute efficiency loss"),
                               ("Clocks were held down", "operations", "operations loss (clocks held down)")):
        if msg.startswith(prefix) and isinstance((items.get(name) or items.get("hardware") or {}).get("fraction"),
                                                 int | float):
            it = items.get(name) or items["hardware"]
            return Gain(max(0.0, it["fraction"]), "bound", str(it.get("source") or "measured"),
                        f"step 1's ledger: {what} {it['fraction']:.1%} of peak x wall time")
    return None


LAYOUT_FIGURE = re.compile(r"(\w+) ([\d.]+)% of the traced step not under compute")


def _kernels(d: dict, msg: str, because: str) -> Gain | None:
    a = d.get("analysis") or {}
    b = a.get("breakdown") or {}
    real = ((d.get("metrics") or {}).get("step_time_median_s") or {}).get("value")  # without the profiler
    step_s, which = (real, "step without the profiler") if isinstance(real, int | float) and real > 0 else (
        a.get("step_time_s"), "profiled step")
    if msg.startswith("Fuse '"):
        pattern = msg[len("Fuse '"):].split("'", 1)[0]
        c = next((c for c in a.get("fusion") or [] if c.get("pattern") == pattern), None)
        if not c:
            return None
        saved = c.get("est_saving_per_step_s")
        if isinstance(saved, int | float) and isinstance(step_s, int | float) and step_s > 0:
            return Gain(saved / step_s, "estimate", "analytic",
                        f"step 3: {saved * 1e3:.2f} ms of memory traffic saved of a {step_s * 1e3:.1f} ms {which} "
                        f"(the pattern takes {c.get('time_per_step_s', 0) / step_s:.1%} of it)")
        return Gain(float(c.get("share_of_step") or 0.0), "bound", "measured",
                    f"step 3: the pattern takes {c.get('share_of_step', 0):.1%} of the profiled step")
    if msg.startswith("The optimiser updates one parameter"):
        opt = a.get("optimizer") or {}
        if isinstance(opt.get("share_of_step"), int | float):
            return Gain(opt["share_of_step"], "bound", "measured",
                        f"step 3: the optimizer step takes {opt['share_of_step']:.1%} of the profiled step, "
                        f"{opt.get('ops_per_step', 0):.0f} {opt.get('what', 'operators')} per step")
    idle = ((d.get("metrics") or {}).get("idle_share") or {}).get("value")
    if msg.startswith("The device is idle between") and isinstance(idle, int | float):  # the step without profiler
        return Gain(idle, "bound", "measured", f"step 3: the device idle {idle:.1%} of the step without the profiler")
    for prefix, name, what in (("The device waits for the next batch", "waiting_for_data", "waiting for data"),
                               ("The device is idle between", "idle", "device idle between operators"),
                               ("Communication is exposed", "communicating", "exposed communication")):
        if msg.startswith(prefix) and isinstance(b.get(name), int | float):
            return Gain(b[name], "bound", "measured", f"step 3: {what} {b[name]:.1%} of the profiled step",
                        "data" if name == "waiting_for_data" else "")
    if msg.startswith(("Data-parallel, communication is exposed", "Almost no communication is hidden")):
        return _share(d, "ddp_exposed_comm_share", "3", "exposed communication in the data-parallel step")
    if msg.startswith("Memory-bound operations"):
        return _share(d, "memory_bound_share", "3", "memory-bound operations, share of the profiled step")
    m = LAYOUT_FIGURE.search(because)
    if m:
        return Gain(float(m.group(2)) / 100, "bound", "measured", f"step 3: {m.group(0)}")
    return None


def _comm_row(rows: list[dict], hook: Any, bucket: Any, view: bool) -> dict | None:
    return next((r for r in rows if r.get("status") == "ok" and r.get("hook") == hook
                 and r.get("bucket_mb") == bucket and bool(r.get("grad_as_bucket_view")) == view), None)


def comm_gain(d: dict[str, Any]) -> float | None:
    """Step 2's DDP gain: the step time of DDP's defaults over the chosen configuration's, in one launch."""
    comm = (d.get("recommendation") or {}).get("comm")
    if not comm:
        return None
    rows = d.get("comm") or []
    chosen = _comm_row(rows, comm.get("hook"), comm.get("bucket_cap_mb"), comm.get("gradient_as_bucket_view", False))
    default = _comm_row(rows, "none", 25, False)
    return (default["step_median_s"] / chosen["step_median_s"] if chosen and default and chosen.get("step_median_s")
            else None)


def _attention_comm(d: dict, msg: str) -> Gain | None:
    rec = d.get("recommendation") or {}
    if msg == rec.get("attention_text"):
        return _speedup(_value(d, "attention_speedup"), "2", "the recommended attention's speedup, side by side")
    if msg == rec.get("comm_text"):
        return _speedup(comm_gain(d), "2", "DDP step time of the defaults / the chosen configuration's")
    if msg.startswith("Exposed communication stays above"):
        return _share(d, "exposed_comm_share", "2", "exposed communication at the best setting")
    return None


def _compile(d: dict, msg: str) -> Gain | None:
    rec = d.get("recommendation") or {}
    if msg != rec.get("text"):
        return None
    if not rec.get("compile"):
        return Gain(0.0, "none", "measured", "step 4: no mode faster than eager beyond the noise")
    return _speedup(_value(d, "speedup"), "4", "compiled step against eager, side by side")


def _fp8(d: dict, msg: str) -> Gain | None:
    pc = (d.get("precision") or {}).get("choice") or {}
    if msg == pc.get("text"):
        if not pc.get("adopted"):
            return Gain(0.0, "none", "measured", "step 5: no lower precision proven faster with its loss kept")
        own = next((r.get("name") for r in (d.get("precision") or {}).get("rungs") or [] if r.get("own")), None)
        if pc.get("rung") == own:  # keeping what the job already trains in gives nothing back
            return Gain(0.0, "none", "measured", f"step 5: {own} is the job's own precision, kept")
        ref = (d.get("precision") or {}).get("reference") or "float32"  # older results: always float32
        return _speedup(pc.get("speedup"), "5", f"{pc.get('rung') or pc.get('dtype')} against {ref}, interleaved")
    if msg == (d.get("choice") or {}).get("text"):
        sp = d.get("speed") or {}
        if sp.get("status") == "ok":
            return _speedup(sp.get("speedup"), "5", "bf16 step / fp8 step, both compiled")
    return None


def _verify(d: dict, msg: str) -> Gain | None:
    if msg.startswith("Adopt the tuned job"):
        return _speedup((d.get("headline") or {}).get("speedup"), "7", "the tuned job against the original, "
                        "side by side")
    return None


RULES: dict[str, Callable[[dict, str, str], Gain | None]] = {
    "baseline": lambda d, m, b: _baseline(d, m), "kernels": _kernels,
    "attention_comm": lambda d, m, b: _attention_comm(d, m), "compile": lambda d, m, b: _compile(d, m),
    "fp8": lambda d, m, b: _fp8(d, m), "verify": lambda d, m, b: _verify(d, m)}


def estimate(key: str, result: dict[str, Any], advice: dict[str, Any]) -> Gain | None:
    """The estimated gain of one piece of a step's advice, or None where no stored figure measures it. Never
    raises: a result of an older shape gives None."""
    rule = RULES.get(key)
    if rule is None:
        return None
    try:
        return rule(result, str(advice.get("message") or ""), str(advice.get("because") or ""))
    except (TypeError, ValueError, KeyError, AttributeError, ZeroDivisionError):
        return None


def rank(order: int, a: dict[str, Any], caps: dict[str, float] | None = None) -> tuple:
    """The sort key of one piece of advice with its ``gain``: those with a gain above zero, the largest first;
    then those with no figure to estimate from; then those that say keep as is; each by severity, then ``order``.
    ``caps``: per topic, the largest estimate of a change measured against that loss; a bound ("up to") on the
    same loss ranks no higher (the change was measured: what could be left is not more than what it gave)."""
    g: Gain | None = a.get("gain")
    group = 1 if g is None else 0 if g.kind != "none" and g.share > 0 else 2
    share = g.share if g is not None and group == 0 else 0.0
    capped = g is not None and g.kind == "bound" and g.topic in (caps or {})
    if capped:
        share = min(share, caps[g.topic])
    return group, -share, int(capped), SEVERITY_ORDER.get(a.get("severity"), 3), order


def caps_of(gains: list[Gain | None]) -> dict[str, float]:
    """Per topic, the largest estimated (not bounded) gain of a change measured against that loss."""
    caps: dict[str, float] = {}
    for g in gains:
        if g is not None and g.topic and g.kind == "estimate":
            caps[g.topic] = max(caps.get(g.topic, 0.0), g.share)
    return caps


def ordered(results: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every step's advice as (step folder, advice with its ``gain``), the largest estimated gain first; then
    those with no figure to estimate from (the ones to act on first, in workbook order); then those that say to
    keep the job as it is."""
    items = []
    for info in STEPS:
        d = results.get(info.key) or {}
        for a in d.get("advice") or []:
            if isinstance(a, dict):
                items.append((len(items), info.folder, {**a, "gain": estimate(info.key, d, a)}))
    caps = caps_of([a["gain"] for _, _, a in items])
    return [(folder, a) for _, folder, a in sorted(items, key=lambda x: rank(x[0], x[2], caps))]


def first_change(items: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]] | None:
    """The first thing to change: the recommendation with the largest estimated gain that is not for information
    only; else the first one to act on (then to look at) with no figure to estimate its gain from; else None."""
    for folder, a in items:
        g = a.get("gain")
        if a.get("severity") in ("act", "look") and g is not None and g.kind != "none" and g.share > 0:
            return folder, a
    rest = [(f, a) for f, a in items if a.get("gain") is None and a.get("severity") in ("act", "look")]
    return min(rest, key=lambda x: SEVERITY_ORDER[x[1]["severity"]], default=None)
