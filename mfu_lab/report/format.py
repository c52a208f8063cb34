"""Values for people: units, source badges, the comparison of two runs as text."""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from markupsafe import Markup

from mfu_lab.core.store.history import Change, Run

e = html.escape


def fmt(value: float | None, unit: str) -> str:
    """A metric value for people: fractions as %, FLOP and bytes with SI prefixes."""
    if value is None:
        return "n/a"
    if isinstance(value, str):  # a stated choice (e.g. a model simplification), not a number
        return f"{value} {unit}".strip()
    if unit == "fraction":
        return f"{value:.1%}"
    if unit in ("FLOP", "FLOP/s", "tokens/s", "samples/s", "bytes", "bytes/s"):
        for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(value) >= scale:
                u = {"bytes": "B", "bytes/s": "B/s"}.get(unit, unit)
                return f"{value / scale:.3g} {prefix}{u}"
        return f"{value:.3g} {unit}"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "steps":
        return f"{value:,.0f} steps"
    if unit == "s":
        if abs(value) < 1e-3:
            return f"{value * 1e6:.1f} µs"
        return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"
    return f"{value:.4g} {unit}"


def impossible(name: str, value: Any, unit: str) -> str:
    """Why a figure cannot be true, or '': a share of a whole (MFU, HFU, a ``*_share`` or ``*_fraction``) outside
    [0, 1]. Such a figure is shown with a warning mark and this sentence, and no advice rests on it."""
    shares = name in ("mfu", "hfu", "ddp_mfu", "baseline_mfu") or name.endswith(("_share", "_fraction"))
    if unit != "fraction" or not shares or not isinstance(value, int | float) or 0.0 <= value <= 1.0:
        return ""
    return (f"{value:.1%} cannot be a share of a whole (outside 0-100%): the parts were measured separately and "
            "do not add up; not used for any recommendation")


def flagged(name: str, value: Any, unit: str) -> Markup:
    """:func:`fmt`, with a warning mark and its reason (as a tooltip and a line) when :func:`impossible`."""
    why = impossible(name, value, unit)
    text = e(fmt(value, unit))
    if not why:
        return Markup(text)
    return Markup(f'{text} <span class="warn" title="{e(why)}">⚠</span><br><small>{e(why)}</small>')


def duration(s: float | None) -> str:
    """A span of time for people: seconds, minutes, hours or days."""
    if s is None:
        return ""
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h" if s < 2 * 86400 else f"{s / 86400:.1f} days"


def share(v: float | None) -> str:
    """A share as a percentage with enough digits to be seen (0.015% rather than 0.0%)."""
    if v is None:
        return ""
    return f"{v:.1%}" if abs(v) >= 0.001 or v == 0 else f"{v * 100:.2g}%"


def badge(source: str) -> Markup:
    """A number's source label (measured, counted, analytic, ...) as a coloured HTML tag."""
    return Markup(f'<span class="src src-{e(source)}">{e(source)}</span>')


def ms(v: float | None) -> str:
    """A duration in seconds for people (µs, ms or s); empty when there is none."""
    return "" if v is None else fmt(v, "s")


def ms0(v: float | None) -> str:
    """A duration, or ``-`` when it is zero or absent (a term the layout does not have)."""
    return "-" if not v else ms(v)


def num(v: Any, spec: str = "", scale: float = 1, suffix: str = "") -> str:
    """``format(v * scale, spec) + suffix``, or empty when ``v`` is None."""
    return "" if v is None else format(v * scale if scale != 1 else v, spec) + suffix


def opt(v: Any, f: Callable[[Any], str], none: str = "") -> str:
    """``f(v)``, or ``none`` when ``v`` is None."""
    return none if v is None else f(v)


def compile_s(v: float | None) -> str:
    """A compile time; at or below zero the first steps were no slower than eager's: within the noise."""
    if v is None:
        return ""
    return f"{v:.1f} s" if v > 0 else f"≈0 ({v:+.1f} s, within noise)"


def compare_text(a: Run, b: Run, changes: list[Change], notes: list[str], show_all: bool = False) -> str:
    """The comparison for a terminal: changed metrics first (or all of them), then how many stayed the same."""
    lines = [f"A: {a.label} ({a.where})", f"B: {b.label} ({b.where})"]
    lines += [f"note: {n}" for n in notes]
    shown = [c for c in changes if show_all or c.verdict != "same"]
    if shown:
        w = max(len(f"{c.step}.{c.metric}") for c in shown)
        lines.append(f"{'metric':<{w}}  {'A':>14}  {'B':>14}  {'change':>8}  {'noise':>6}  verdict")
        for c in shown:
            ch = f"{c.rel:+.1%}" if c.rel is not None else ""
            label = c.source_b or c.source_a or ""
            lines.append(f"{c.step + '.' + c.metric:<{w}}  {fmt(c.a, c.unit):>14}  {fmt(c.b, c.unit):>14}  "
                         f"{ch:>8}  {c.tolerance:>6.1%}  {c.verdict} ({label})")
    same = sum(c.verdict == "same" for c in changes)
    lines.append(f"{same} of {len(changes)} metrics the same within noise; "
                 f"{sum(c.verdict == 'better' for c in changes)} better, {sum(c.verdict == 'worse' for c in changes)}"
                 f" worse, {sum(c.verdict in ('higher', 'lower') for c in changes)} moved (no better side), "
                 f"{sum(c.verdict.startswith('only') or c.verdict == 'no value' for c in changes)} with a value in "
                 "one run only")
    return "\n".join(lines)
