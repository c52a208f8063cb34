"""Step 5's precision rungs: what each is (its dtype and float32 matmul precision), the job's plan of them, whether
one can run on this device, and the matmul probes that rule a rung out before anything is built (measured)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from mfu_lab.analysis import precision as pr
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev

TF32_CAPABILITY = (8, 0)  # Ampere and later have TF32 tensor cores
REFERENCE = "float32"
SETTINGS = {"float32": ("float32", "highest"), "tf32": ("float32", "high"),
            "bfloat16": ("bfloat16", "highest"), "float16": ("float16", "highest")}
WORDS = {"float32": "float32", "tf32": "TF32 matmuls", "bfloat16": "bfloat16 autocast",
         "float16": "float16 autocast with a loss scaler"}
PROBE_N = {"cpu": 256, "cuda": 4096}  # square matmul size of the probes: compute-bound; on a GPU large enough that
# the host clock and synchronize around each call stay small (2048 in bf16 on an H200: ~25 us, about the overhead)
PROBE_S = 0.02  # seconds each probe times (after its warm-up call): PROBES x rungs probes stay well under 1 s
NOT_RUN = (pr.SKIPPED, pr.FAILED, pr.CANNOT_BE_FASTER)  # statuses of a rung that is not (or no longer) trained
NO_NATIVE_BF16 = ("this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag in /proc/cpuinfo), so bf16 autocast "
                  "is emulated in software and much slower, and it is not adopted")


@dataclass
class Rung:
    name: str
    dtype: str
    matmul_precision: str
    own: bool = False  # the job's own precision
    status: str = ""
    reason: str = ""
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    final_gap: float | None = None
    diverged: str = ""
    stopped_at: int | None = None
    scaler_skipped: int = 0  # float16 steps the loss scaler skipped (an overflow lowered its scale)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)  # per step of the loss curve (the divergence watch's)
    loss_s: float | None = None  # seconds the loss curve took to train
    loss_skipped: str = ""  # why no loss curve was trained (racing: not proven faster, so never adoptable)
    probe: dict = field(default_factory=dict)  # its matmul probes (measured), float32's beside a ruled-out rung's
    step_probe_s: float | None = None  # under a budget: one training step before the rounds (measured, an estimate)

    def fail(self, what: str, err: BaseException) -> None:
        if self.status != pr.FAILED:
            self.status, self.reason = pr.FAILED, f"{what}: {type(err).__name__}: {err}"[:400]


def plan(job: Job, own_first: bool = False) -> list[Rung]:
    """float32 first (the reference), the job's rungs, and the job's own precision when it is none of them;
    ``own_first`` (under a budget): the job's own precision first instead, as the reference."""
    own = (job.dtype, job.matmul_precision)
    names = [REFERENCE] + [n for n in dict.fromkeys(job.precision_rungs) if n != REFERENCE]
    rungs = [Rung(n, *SETTINGS[n]) for n in names]
    mine = next((r for r in rungs if (r.dtype, r.matmul_precision) == own), None)
    if mine is None:
        name = job.dtype if job.matmul_precision == "highest" or job.dtype == "float32" else f"{job.dtype} + tf32"
        mine = Rung("tf32" if own == SETTINGS["tf32"] else name, *own)
        rungs.append(mine)
    mine.own = True
    if own_first:
        rungs = [mine] + [r for r in rungs if r is not mine]
    return rungs


def unavailable(rung: Rung, device: dev.DeviceInfo) -> str:
    """'' when the rung can run on this device, else why not."""
    if rung.name != "tf32":
        return ""
    if device.type != "cuda":
        return ("TF32 is a tensor-core format of NVIDIA GPUs (capability 8.0 and up); a CPU has none, and "
                "matmul_precision 'high' changes nothing here")
    cap = torch.cuda.get_device_capability(device.index)
    if cap < TF32_CAPABILITY and not torch.version.hip:
        return f"CUDA capability {cap[0]}.{cap[1]} has no TF32 tensor cores (8.0 and up do)"
    return ""


def probe(rung: Rung, device: dev.DeviceInfo) -> float:
    """One short probe of the rung's matmul rate (FLOP/s, measured): the CPU peak's own measurement
    (:func:`mfu_lab.core.measure.device.measure_matmul_peak`) at one size and a ~20 ms budget, in the rung's dtype (what
    autocast casts a linear layer's inputs to) and float32 matmul precision."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(rung.matmul_precision)
    try:
        return dev.measure_matmul_peak(getattr(torch, rung.dtype), device.type, sizes=(PROBE_N.get(device.type, 256),),
                                       budget_s=PROBE_S)[0]
    finally:
        torch.set_float32_matmul_precision(before)


def probe_all(job: Job, rungs: list[Rung], device: dev.DeviceInfo, say) -> None:
    """Probe every runnable rung, interleaved (each once per round, ``PROBES`` rounds); rule out, before they are
    built, the rungs whose rate cannot reach float32's within the probes' noise (``thorough``: only say so)."""
    live = [r for r in rungs if r.status not in NOT_RUN]
    rates: dict[str, list[float]] = {r.name: [] for r in live}
    t0 = time.perf_counter()
    try:
        for _ in range(pr.PROBES):
            for r in live:
                rates[r.name].append(probe(r, device))
    except Exception as err:  # noqa: BLE001 - without probes every rung is timed, as before
        say(f"matmul probes failed ({type(err).__name__}: {err}): every rung is timed")
        return
    n = PROBE_N.get(device.type, 256)
    how = (f"{pr.PROBES} interleaved probes of square {n} x {n} matmuls, each the best over {PROBE_S * 1e3:.0f} ms "
           "(core.measure.device.measure_matmul_peak, the CPU peak's measurement)")
    for r in live:
        r.probe = pr.probe_summary(rates[r.name]) | {"how": how}
    ref, name = rungs[0].probe, rungs[0].name
    say(f"matmul probes ({time.perf_counter() - t0:.2f} s): " + ", ".join(
        f"{r.name} {pr.gflops(r.probe)}" for r in live))
    for r in live:
        if r is rungs[0] or not pr.cannot_be_faster(r.probe, ref):
            continue
        r.probe |= {"cannot_be_faster": True, "float32_flops_per_s": ref["flops_per_s"], "float32_p10": ref["p10"],
                    "float32_p90": ref["p90"], "reference": name,  # float32_*: the reference's (its name)
                    "reason": pr.probe_reason(r.probe, ref, job.thorough, name)}
        if not job.thorough:
            r.status, r.reason = pr.CANNOT_BE_FASTER, r.probe["reason"]
        say(f"  {r.name}: {pr.CANNOT_BE_FASTER}: {r.probe['reason']}")


def as_job(job: Job, rung: Rung) -> Job:
    return dataclasses.replace(job, dtype=rung.dtype, matmul_precision=rung.matmul_precision)


def figures(r: Rung, reference: str = REFERENCE) -> str:
    out = []
    if r.speedup_low is not None:
        out.append(f"{r.speedup:.2f}x [{r.speedup_low:.2f}, {r.speedup_high:.2f}] against {reference}")
    if r.final_gap is not None:
        out.append(f"final loss {r.final_gap:+.2%}")
    return ", ".join(out)
