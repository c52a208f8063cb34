"""Which adopted changes may stand together, and the staircase step 7 climbs with them.

Each step measured its change on the job as it came, alone. Together two may make a job the validator refuses
(step 4's unconfirmed compile mode beside ``loss_impl: chunked``, which its loss race picked eagerly), or undo each
other (step 3's batch split applied after step 6's layout, which scales ``micro_batch`` itself). Here:

- :func:`batch_beside_layout`: the split gives way to a layout that sets ``micro_batch``;
- :func:`combinable`: until the tuned job is valid, one step's changes give way, with why: of a refused pair
  (:data:`CLASHES`) the proposed one, else the later rung's; otherwise the latest whose leaving clears the problem;
- :func:`staircase`: the rungs in the workflow's order, a rung the job refuses alone climbed right after the rung
  that mends it (rungs that need each other, climbed as one).
"""

from __future__ import annotations

import re
from typing import Any

from mfu_lab.analysis.change import RUNGS, Change, tuned_job
from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.job.schema import Job, validate

BESIDE_LAYOUT = "beside step 6's layout: "


def batch_beside_layout(chosen: list[Change]) -> list[Change]:
    """Step 3's batch split left out where step 6's layout sets micro_batch too: each was measured on the job's own
    layout and keeps its samples per optimizer step on its own (the layout scales micro_batch to its data-parallel
    degree), so the two together would not (a micro_batch applied last would undo the layout's scale). Decided
    before step 7's withdrawals apply (:func:`mfu_lab.analysis.tuning.in_effect`): a layout step 7 took back does
    not bring the split back untimed."""
    lay = next((c for c in chosen if c.adopted and c.rung == "layout" and c.key == "micro_batch"), None)
    for c in chosen if lay else []:
        if c.adopted and c.rung == "batch" and c.step != "verify":
            c.adopted, c.reason = False, (
                f"{BESIDE_LAYOUT}the layout sets micro_batch {lay.new} to keep the samples per optimizer step in its "
                "data-parallel degree, and step 3 raced micro_batch x grad_accum in the job's own layout; run the "
                "workbook on tuned.yaml to race the split in the new layout")
    return chosen


# pairs of keys whose changes may not stand together (core.job.rules refuses the pair): the validator names the
# first; a proposed change gives way to a measured one, else the later rung gives way (its race ran without the other)
CLASHES = (("loss_impl", "compile_mode"),)
CLASH_REASON = "the tuned job would be invalid with it beside "


def _problems(job: Job, chosen: list[Change], without: tuple[Change, ...] = ()) -> list[JobProblem]:
    """What the validator refuses in the tuned job of ``chosen`` less ``without`` ([] when it is valid)."""
    left = [c for c in chosen if c.adopted and not any(c is w for w in without)]
    try:
        tuned_job(job, left)
    except JobError as e:
        return e.problems
    return []


def _group(chosen: list[Change], c: Change) -> tuple[Change, ...]:
    """The adopted changes of ``c``'s step on ``c``'s rung: one decision (a split's micro_batch and grad_accum, a
    layout's keys, a compile mode with its seq_policy), left out together."""
    return tuple(x for x in chosen if x.adopted and x.rung == c.rung and x.step == c.step)


def _latest_first(c: Change) -> int:
    return -RUNGS.index(c.rung) if c.rung in RUNGS else 0


def combinable(job: Job, chosen: list[Change]) -> list[Change]:
    """``chosen`` with the changes that cannot stand together left out, with why, until the tuned job is valid.
    Of a refused pair (:data:`CLASHES`) the proposed change's step gives way to the measured one, else the later
    rung's; any other problem: the latest step's changes whose leaving clears the problem's key (else the
    latest's)."""
    for _ in range(len(chosen) + 1):
        found = _problems(job, chosen)
        if not found:
            break
        problem, live = found[0], [c for c in chosen if c.adopted]
        pair = next((p for p in CLASHES if p[0] == problem.key), (problem.key,))
        both = sorted((c for c in live if c.key in pair), key=lambda c: (c.label != "proposed", _latest_first(c)))
        order = both or sorted(live, key=_latest_first)
        groups = list({tuple(map(id, g)): g for g in (_group(chosen, c) for c in order)}.values())
        drop = next((g for g in groups if problem.key not in {q.key for q in _problems(job, chosen, g)}),
                    groups[0] if groups else ())
        if not drop:
            break
        kept = [c for c in both if not any(c is d for d in drop)]
        text = re.sub(r"; use [^;]*$", "", str(problem))  # the validator's hint to a job's author, not to a reader here
        beside = ", ".join(f"{c.key}: {c.new} ({c.label})" for c in kept) or "the other changes"
        keep = f"; keep: [{kept[0].key}] in the job would let step 7 time this change instead" if kept else ""
        for c in drop:
            c.adopted, c.reason = False, f"{CLASH_REASON}{beside}: {text}{keep}"
    return chosen


def staircase(job: Job, chosen: list[Change]) -> list[tuple[str, Job, list[Change]]]:
    """(rung, job, its changes) from the original job up, one rung per stage that adopted a change, in the workflow's
    order (:data:`RUNGS`); each rung's job differs from the previous one by exactly that rung's changes.
    A rung the validator refuses on the rungs below (step 4's compile mode on a job already on ``loss_impl:
    chunked``, whose loss race picked ``compiled``) is climbed right after the later rung that mends it; rungs that
    still need each other at the top are climbed as one ("compile + loss"), refused only if the tuned job is."""
    pending = [(rung, [c for c in chosen if c.adopted and c.rung == rung]) for rung in RUNGS]
    pending = [(rung, mine) for rung, mine in pending if mine]
    steps: list[tuple[str, Job, list[Change]]] = [("original", job, [])]
    values: dict[str, Any] = job.to_dict()
    while pending:
        for i, (rung, mine) in enumerate(pending):
            above = values | {c.key: c.new for c in mine}
            try:
                steps.append((rung, validate(above, f"staircase rung {rung}"), mine))
            except JobError:
                continue
            values = above
            del pending[i]
            break
        else:  # none can be climbed alone: the rest as one rung
            name, mine = " + ".join(r for r, _ in pending), [c for _, m in pending for c in m]
            steps.append((name, validate(values | {c.key: c.new for c in mine}, f"staircase rung {name}"), mine))
            break
    return steps
