"""The precision ladder's pure parts: whether a CPU has native bf16, and the rule that adopts a precision.

A lower precision is adopted only on two kinds of evidence at once: its speedup over float32, measured in
interleaved rounds, has a 95% interval entirely above 1.0 (proven faster, not just faster on the median),
and its loss curve from the same seed and batches stayed within the job's ``loss_tolerance`` of float32's
without the divergence watch stopping it. Among the rungs that pass both, the fastest (highest median
speedup) is adopted, but a rung other than the job's own only when its interval lies above the job's own rung's
(faster than what the job already has, beyond the noise); when none passes, the job keeps its own precision.

Before any of that, a rung must be able to win at all: a few short matmul probes of each precision
(:func:`mfu_lab.core.measure.device.measure_matmul_peak`, well under a second in all) measure its matmul rate beside
float32's. A rung whose probes cannot reach float32's within the probes' own noise (its p90 below float32's
p10, :func:`cannot_be_faster`) is recorded as "cannot be faster here" with both rates and is neither trained
nor timed (``--thorough`` still times it): bf16 and fp16 on a CPU without native units run in software, 15x
slower and more, and timing them took tens of minutes.

Under a budget step 5 takes the job's own precision as the reference instead of float32 (``reference=``): every
speedup and loss gap is then against what the job already trains in, so a rung is adopted only when it beats
the job's own beyond the noise, measured side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mfu_lab.core.measure.timed import percentile

CPUINFO = Path("/proc/cpuinfo")
# CPU flags of native bf16 arithmetic: x86 AVX-512 BF16 and AMX BF16 (Linux /proc/cpuinfo "flags"), and the
# Arm BF16 extension ("Features: ... bf16" on aarch64). Without them, bf16 autocast runs in software.
BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

# statuses a rung may end with
REFERENCE, ADOPTED, OK = "reference", "adopted", "ok"
NOT_FASTER, SLOWER, OFF, DIVERGED = "not faster", "slower", "off", "diverged"
SKIPPED, FAILED = "skipped", "failed"
CANNOT_BE_FASTER = "cannot be faster here"  # its matmul probe cannot reach float32's: not trained or timed
UNJUDGED = (REFERENCE, SKIPPED, FAILED, CANNOT_BE_FASTER)  # statuses the rule leaves as they are

PROBES = 5  # short matmul probes per precision, interleaved; their own p10-p90 is the noise


def probe_summary(rates: list[float]) -> dict:
    """One precision's matmul probes (FLOP/s, measured): median and p10-p90 over the probes."""
    if not rates:
        raise ValueError("no probe rates to summarise")
    return {"flops_per_s": percentile(rates, 50), "p10": percentile(rates, 10), "p90": percentile(rates, 90),
            "rates": list(rates), "label": "measured"}


def cannot_be_faster(rung: dict, reference: dict) -> bool:
    """True when a rung's matmul probes cannot reach float32's within the probes' noise: even its fast end (p90)
    is below float32's slow end (p10). Overlapping probes, or missing ones, rule nothing out."""
    try:
        return float(rung["p90"]) < float(reference["p10"])
    except (KeyError, TypeError, ValueError):
        return False


def gflops(summary: dict) -> str:
    """'1.0 GFLOP/s (p10-p90 0.9-1.1)' of a probe summary."""
    return (f"{summary['flops_per_s'] / 1e9:.3g} GFLOP/s (p10-p90 {summary['p10'] / 1e9:.3g}-"
            f"{summary['p90'] / 1e9:.3g})")


def probe_reason(rung: dict, reference: dict, thorough: bool = False, name: str = "float32") -> str:
    """Why a rung cannot be faster here, with both rates (one clause: no ';', which the choice splits on);
    ``name``: the reference rung's."""
    then = "timed anyway because --thorough" if thorough else "not trained or timed (--thorough times it)"
    return (f"its matmul probe reached {gflops(rung)} against {name}'s {gflops(reference)}, measured, below "
            f"{name}'s within the probes' noise: {then}")


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


def verdict(f: Figures, tolerance: float, reference: str = "float32") -> tuple[str, str]:
    """(status, reason) of one rung under the rule; the loss is judged before the speed. ``reference``: the rung
    the speedups and loss gaps are taken against (float32, or the job's own under a budget)."""
    if f.status in UNJUDGED:
        return f.status, ""
    if f.diverged:
        return DIVERGED, f.diverged
    if f.final_gap is None and f.loss_skipped and f.speedup_low is not None and f.speedup_low <= 1.0:
        interval = f"{f.speedup:.2f}x [{f.speedup_low:.2f}, {f.speedup_high:.2f}]"
        if f.speedup_high < 1.0:
            return SLOWER, f"{interval}: proven slower than {reference}; {f.loss_skipped}"
        return NOT_FASTER, f"{interval}: the interval contains 1.0, so not proven faster; {f.loss_skipped}"
    if f.final_gap is None:
        return FAILED, "no loss curve to judge"
    if f.final_gap > tolerance:
        return OFF, f"final loss {f.final_gap:+.2%} from {reference}'s (tolerance {tolerance:.0%})"
    if f.speedup is None or f.speedup_low is None or f.speedup_high is None:
        return FAILED, "no step times to judge"
    interval = f"{f.speedup:.2f}x [{f.speedup_low:.2f}, {f.speedup_high:.2f}]"
    if f.speedup_low > 1.0:
        return OK, f"{interval} faster, final loss {f.final_gap:+.2%} from {reference}'s"
    if f.speedup_high < 1.0:
        return SLOWER, f"{interval}: proven slower than {reference}"
    return NOT_FASTER, f"{interval}: the interval contains 1.0, so not proven faster"


def beyond(f: Figures, base: Figures) -> bool:
    """Whether ``f`` is faster than ``base`` beyond the noise: its speedup interval over float32 lies wholly above
    ``base``'s (the two intervals do not overlap)."""
    return None not in (f.speedup_low, base.speedup_high) and f.speedup_low > base.speedup_high


def judge(rungs: list[Figures], tolerance: float, own: str = "",
          reference: str = "float32") -> tuple[list[tuple[str, str]], str | None]:
    """Every rung's (status, reason), and the adopted rung's name (the fastest that passes) or None.

    ``own`` names the job's own rung. When it passes the rule itself, another rung is adopted only when it is
    faster than the job's own beyond the noise (:func:`beyond`); the others stay ``ok`` with that said, and the
    job's own is the one adopted (no change). A point estimate ahead inside overlapping intervals is noise: the
    first H200 run moved a bf16 job to TF32 on 2.64x [2.42, 2.82] against bf16's 2.38x [2.27, 2.65]."""
    out = [verdict(f, tolerance, reference) for f in rungs]
    passed = [(f.speedup, i) for i, (f, (s, _)) in enumerate(zip(rungs, out)) if s == OK]
    if not passed:
        return out, None
    mine = next((i for i, f in enumerate(rungs) if f.name == own and out[i][0] == OK), None)
    if mine is not None:
        base = rungs[mine]
        for _, i in passed:
            if i != mine and not beyond(rungs[i], base):
                out[i] = (OK, out[i][1] + f"; not faster than the job's own {own} beyond the noise "
                                          f"({base.speedup:.2f}x [{base.speedup_low:.2f}, {base.speedup_high:.2f}])")
        passed = [(sp, i) for sp, i in passed if i == mine or beyond(rungs[i], base)]
    _, best = max(passed)
    out[best] = (ADOPTED, out[best][1])
    return out, rungs[best].name
