"""The precision ladder's pure parts: whether a CPU has native bf16, and the rule that adopts a precision.

A lower precision is adopted only on two kinds of evidence at once: its speedup over float32, measured in
interleaved rounds, has a 95% interval entirely above 1.0 (proven faster, not just faster on the median),
and its loss curve from the same seed and batches stayed within the job's ``loss_tolerance`` of float32's
without the divergence watch stopping it. Among the rungs that pass both, the fastest (highest median
speedup) is adopted; when none passes, the job keeps its own precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# CPU flags of native bf16 arithmetic: x86 AVX-512 BF16 and AMX BF16 (Linux /proc/cpuinfo "flags"), and the
# Arm BF16 extension ("Features: ... bf16" on aarch64). Without them, bf16 autocast runs in software.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

# statuses a rung may end with
REFERENCE, ADOPTED, OK = "reference", "adopted", "ok"
NOT_FASTER, SLOWER, OFF, DIVERGED = "not faster", "slower", "off", "diverged"
SKIPPED, FAILED = "skipped", "failed"
UNJUDGED = (REFERENCE, SKIPPED, FAILED)  # statuses the rule leaves as they are


def native_bf16(text: str | None = None) -> dict:
    """Which native-bf16 flags this CPU reports: ``{"flags": [...], "native": bool | None, "source": ...}``.

    ``text`` is a /proc/cpuinfo text (read from this machine when None); ``native`` is None when it cannot
    be read (not Linux), so nothing is claimed either way.
    """
    source = "given text" if text is not None else str(CPUINFO)
    if text is None:
        try:
            text = CPUINFO.read_text(errors="replace")
        except OSError:
            return {"flags": [], "native": None, "source": f"{CPUINFO} unreadable"}
    found: set[str] = set()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            found |= set(value.split()) & set(BF16_FLAGS)
    flags = [f for f in BF16_FLAGS if f in found]
    return {"flags": flags, "native": bool(flags), "source": source}


@dataclass
class Figures:
    """What the rule needs of one rung: its speedup over float32 (median and interval) and its loss check."""

    name: str
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    final_gap: float | None = None  # last-window mean loss / float32's - 1
    diverged: str = ""  # the divergence watch's reason; '' when it let the curve run to the end
    status: str = ""  # preset to reference | skipped | failed to leave the rung out of the judgement
    loss_skipped: str = ""  # why no loss curve was trained (a race: the speed alone rules the rung out)


def verdict(f: Figures, tolerance: float) -> tuple[str, str]:
    """(status, reason) of one rung under the rule; the loss is judged before the speed."""
    if f.status in UNJUDGED:
        return f.status, ""
    if f.diverged:
        return DIVERGED, f.diverged
    if f.final_gap is None and f.loss_skipped and f.speedup_low is not None and f.speedup_low <= 1.0:
        interval = f"{f.speedup:.2f}x [{f.speedup_low:.2f}, {f.speedup_high:.2f}]"
        if f.speedup_high < 1.0:
            return SLOWER, f"{interval}: proven slower than float32; {f.loss_skipped}"
        return NOT_FASTER, f"{interval}: the interval contains 1.0, so not proven faster; {f.loss_skipped}"
    if f.final_gap is None:
        return FAILED, "no loss curve to judge"
    if f.final_gap > tolerance:
        return OFF, f"final loss {f.final_gap:+.2%} from float32's (tolerance {tolerance:.0%})"
    if f.speedup is None or f.speedup_low is None or f.speedup_high is None:
        return FAILED, "no step times to judge"
    interval = f"{f.speedup:.2f}x [{f.speedup_low:.2f}, {f.speedup_high:.2f}]"
    if f.speedup_low > 1.0:
        return OK, f"{interval} faster, final loss {f.final_gap:+.2%} from float32's"
    if f.speedup_high < 1.0:
        return SLOWER, f"{interval}: proven slower than float32"
    return NOT_FASTER, f"{interval}: the interval contains 1.0, so not proven faster"


def judge(rungs: list[Figures], tolerance: float) -> tuple[list[tuple[str, str]], str | None]:
    """Every rung's (status, reason), and the adopted rung's name (the fastest that passes) or None."""
    out = [verdict(f, tolerance) for f in rungs]
    passed = [(f.speedup, i) for i, (f, (s, _)) in enumerate(zip(rungs, out)) if s == OK]
    if not passed:
        return out, None
    _, best = max(passed)
    out[best] = (ADOPTED, out[best][1])
    return out, rungs[best].name
