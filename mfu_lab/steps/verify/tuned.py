"""The verify step's tuned job: built from the earlier steps' stored results and written as ``tuned.yaml``.

Steps 1-6 each store what they recommend; :mod:`mfu_lab.analysis.tuning` turns those results into changes and
stacks the adopted ones on the job, and this module reads the results (saying why a missing one is missing) and
writes ``<out>/<job>/tuned.yaml``, with what step 7 adopted itself read last. Step 7's own finding is the attention
re-check: when step 2 chose its attention at another precision than the tuned job trains in, the other
implementation is timed again beside the tuned job (a challenger rung) and, faster beyond the noise, becomes a
change of step 7's own.
"""

from __future__ import annotations

from pathlib import Path

from mfu_lab.analysis import tuned_file, tuning
from mfu_lab.core.job.schema import Job, validate
from mfu_lab.core.registry import STEPS
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import write_atomic

TUNED_FILE = "tuned.yaml"


def earlier_results(job: Job) -> tuple[dict[str, dict], list[str]]:
    """The stored results of steps 1-6 (key -> dict), and why each missing one is missing."""
    found, missing = {}, []
    for info in STEPS:
        if info.number > 6:  # step 6 too: a layout it measured faster here is proposed (analysis.layouts.proposal)
            continue
        e = store.earlier(job, info.key)
        if e:
            found[info.key] = e.data
        else:
            missing.append(e.reason)
    return found, missing


def write_tuned(job: Job, keep: list[str] | tuple[str, ...] = (), source: str = "the job",
                run_id: str = "") -> tuple[Path, list[tuning.Change]]:
    """Write ``<out>/<job>/tuned.yaml`` from the steps' stored results; return its path and the changes."""
    results, _ = earlier_results(job)
    mine = store.earlier(job, "verify")
    if mine:  # what step 7 adopted itself (an attention re-checked at the tuned precision)
        results["verify"] = mine.data
    chosen = tuning.changes(job, results, keep)
    return save_tuned(job, chosen, source, run_id), chosen


def withdrawn_keys(job: Job) -> list[str]:
    """The keys step 7's stored result took back to the job's values (not measured faster, or not timed)."""
    mine = store.earlier(job, "verify")
    return list(dict.fromkeys(str(c.key) for c in tuning.withdrawals(mine.data))) if mine else []


def save_tuned(job: Job, chosen: list[tuning.Change], source: str = "the job", run_id: str = "") -> Path:
    """Write the tuned job of these changes as ``<out>/<job>/tuned.yaml``, atomically."""
    return write_atomic(job.output_root() / TUNED_FILE, tuned_file.tuned_yaml(job, chosen, source, run_id))


def attention_recheck(job: Job, results: dict[str, dict], tuned: Job) -> tuple[Job, str] | None:
    """The tuned job with the other attention implementation, when step 2 chose attention at another precision
    than the tuned job trains in (a choice at float32 need not hold at bfloat16); None otherwise."""
    step2 = results.get("attention_comm")
    if not step2 or not job.uses_reference_model:
        return None
    measured_at = (step2.get("job") or {}).get("dtype", job.dtype)
    if measured_at == tuned.dtype:
        return None
    other = "unfused" if tuned.attention == "sdpa" else "sdpa"
    why = (f"step 2 chose {tuned.attention} at {measured_at}; the tuned job trains in {tuned.dtype}, so {other} "
           "is timed again beside it and adopted only if faster beyond the noise")
    return validate(tuned.to_dict() | {"attention": other}, f"attention re-check at {tuned.dtype}"), why


def recheck_change(tuned: Job, challenger) -> tuning.Change:
    """Step 7's own change when the re-checked attention (the ``challenger`` rung) won against the tuned job."""
    return tuning.Change(
        "attention", "verify", "attention", tuned.attention, challenger.keys["attention"],
        f"step 7: {challenger.keys['attention']} {challenger.gain:.2f}x [{challenger.gain_low:.2f}, "
        f"{challenger.gain_high:.2f}] the tuned job's {tuned.attention} at {challenger.dtype}, side by side (measured)",
        "measured")
