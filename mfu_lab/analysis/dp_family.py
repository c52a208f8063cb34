"""Step 2's loss check over the data-parallel family (DDP configurations and FSDP2 candidates).

Every candidate is measured in full on the same batches per rank, from the same initial weights, after the same
number of steps; its last timed step's loss (rank 0's) is then comparable with the reference's (DDP's defaults).
A candidate that changes the numbers (a compressing DDP hook, FSDP2 reducing gradients in bfloat16 or float16) may
be picked only when that loss lies within the job's ``loss_tolerance`` of the reference's; one whose loss was not
read is never picked. A lossless candidate (float32 reductions, which differ by summation order only) is held to
the same tolerance, which it meets by orders of magnitude.

Pure functions over the workers' events (dicts): the worker (its in-launch confirmation) and the step decide with
the same rule.
"""

from __future__ import annotations

import math

LOSSY_HOOKS = ("fp16_compress", "bf16_compress", "powersgd")


def lossy(cfg: dict) -> bool:
    """Whether a candidate changes the numbers beyond summation order."""
    if cfg.get("kind") == "fsdp":
        return cfg.get("reduce_dtype", "float32") != "float32"
    return cfg.get("hook") in LOSSY_HOOKS


def loss_gap(loss: float | None, reference: float | None) -> float | None:
    """Relative gap |loss - reference| / |reference|; None when either is missing or not finite."""
    if loss is None or reference is None or not math.isfinite(loss) or not math.isfinite(reference) or not reference:
        return None
    return abs(loss - reference) / abs(reference)


def loss_verdict(cfg: dict, loss: float | None, reference: float | None, tolerance: float | None) -> tuple[bool, str]:
    """(may be picked, why not): the adoption rule of step 2's loss check."""
    if tolerance is None:
        return True, ""
    gap = loss_gap(loss, reference)
    if gap is None:
        if lossy(cfg):
            return False, "lossy, and its loss was not compared with the reference's: not adopted"
        return True, ""
    if gap > tolerance:
        return False, (f"final loss {gap:.2%} from the reference's, above loss_tolerance {tolerance:.0%}: not "
                       "adopted")
    return True, ""


def loss_ok(ev: dict, reference_ev: dict | None, tolerance: float | None) -> bool:
    """:func:`loss_verdict` over two workers' ``done`` events."""
    return loss_verdict(ev.get("config") or {}, ev.get("loss"), (reference_ev or {}).get("loss"), tolerance)[0]
