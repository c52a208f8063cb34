"""Step 7, verify: how much did the workflow give back on this job, measured side by side?

Every earlier step measures its own change alone. This step stacks the changes they adopted
(:mod:`mfu_lab.analysis.tuning`) into the tuned job, writes it as ``<out>/<job>/tuned.yaml``, and measures
the **staircase**: the original job, then the job with each adopted change added in the workflow's order
(attention -> communication -> data -> compile -> precision -> FP8). Each rung runs in its own process
(compile and allocator state stay apart), warmed up first, then all rungs run in interleaved rounds
(A B C, A B C, ...) with the same seed and batches, so that drift hits every rung alike
(:mod:`mfu_lab.core.measure.sidebyside`). Per rung: median step time and p10-p90; tokens/s and MFU over the total wall
time of its measured steps, as in step 1; and the speedup
over the original and over the rung below, each with a bootstrap interval; a rung whose interval
contains 1.0 is "not proven". The loss curves of the original and the tuned job over the same steps
are compared at the end against ``loss_tolerance``. The ledgers before and after come from the same
method on both (the single-process ledger of the interleaved steps).

A proposed change (or an FP8 rung) not measured faster than the rung below beyond the noise is withdrawn; when a
rung kept above it was measured with it, the tuned file as written is timed again beside the original
(:mod:`mfu_lab.steps.verify.retime`), and the headline is that pair's.

FP8 that is only emulated on this device is not adopted (analysis.tuning), so it has no rung; an FP8 rung whose
process (or, in a layout, whose ranks) trained without FP8 is excluded, with the reason. DDP
changes are verified under DDP (the original and the tuned DDP configuration alternated in one torchrun
launch) when the job runs data-parallel. Writes ``<out>/<job>/07_verify/result.json``.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from mfu_lab.analysis import tuning
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.layout import beyond_ddp
from mfu_lab.core.engine.layout_check import graphs_problem
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.ledger import Ledger
from mfu_lab.core.process.budget import Clock, cold_compile, fit_verify, job_step_s
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.nodes import launcher_folder
from mfu_lab.core.store.results import Metric, StepResult
from mfu_lab.steps.verify import memory_share, retime, staircase
from mfu_lab.steps.verify.ddp import ddp_configs, torchrun_reason, verify_ddp
from mfu_lab.steps.verify.layout import layout_change, measure_in_layout
from mfu_lab.steps.verify.rungs import Rung, give_peaks, measure_rungs, staircase_rungs
from mfu_lab.steps.verify.tuned import TUNED_FILE, attention_recheck, earlier_results, recheck_change, save_tuned
from mfu_lab.workers.launch import world_layout

INFO = BY_KEY["verify"]


@dataclass
class VerifyResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    changes: list[dict[str, Any]]  # every recommended change (analysis.tuning.Change), adopted or not
    tuned_file: str
    rungs: list[Rung]
    order: list[list]  # [round, rung] in the order run
    loss: dict[str, Any]
    ledgers: dict[str, Ledger]  # before, after
    ddp: dict[str, Any]
    headline: dict[str, Any]
    advice: list[Advice]
    memory: dict[str, Any] = field(default_factory=dict)  # on CUDA: each rung's share of the GPU (memory_share)


Result = VerifyResult  # the step contract: every step module names its result class Result


@guarded("verify")
def run(job: Job, progress=None, write: bool = True, keep: list[str] | tuple[str, ...] = ()) -> VerifyResult:
    """Write the tuned job and measure its staircase against the original; see the module docstring."""
    t_start = time.perf_counter()
    say = as_progress(progress)
    device = dev.resolve_device(job.device)
    results, missing = earlier_results(job)
    skipped = [{"what": "an earlier step's changes", "reason": m} for m in missing]
    chosen = tuning.changes(job, results, keep)
    clock = Clock.for_step(job, INFO.key)
    skipped += untimed_proposals(job, chosen, clock, results.get("compile"))
    skipped += graphs_clash(job, chosen, device.type)
    tuning.combinable(job, chosen)  # a guard, as tuning.settle ends: what is left after step 7's leaving-out validates
    tuned_path = job.output_root() / TUNED_FILE
    if write:
        save_tuned(job, chosen)
    say(f"steps 1-6: {sum(c.adopted for c in chosen)} change(s) adopted of {len(chosen)} recommended; tuned job: "
        f"{tuned_path}")

    stairs = tuning.staircase(job, chosen)
    chosen += untimed_reverts(job, chosen)  # after the staircase: recorded so that a re-read tuned.yaml holds it
    rungs, jobs = staircase_rungs(stairs, device)
    plan: dict[str, Any] = {}
    recheck = attention_recheck(job, results, stairs[-1][1])
    if recheck:
        rjob, why = recheck
        rungs.append(Rung(f"attention at {rjob.dtype}", {"attention": rjob.attention}, "ok", why, rjob.dtype,
                          challenger=True))
        jobs.append(rjob)
        say(f"attention at {rjob.dtype}: {why}")
    give_peaks(job, device, rungs, jobs, say)
    work = launcher_folder(job.step_dir(INFO.folder) / "work")  # one per node: nodes share no progress file
    timed = (ok := sum(r.status == "ok" for r in rungs)) > 1  # the original and at least one rung to time against it
    nnodes, nproc = world_layout(job, device.type)
    step_s = job_step_s(results.get("baseline"))
    reserve = ((0.0, "") if beyond_ddp(job) else  # a layout's staircase is not timed twice
               retime.reserve(job, stairs, rungs, jobs, withdrawable, step_s[0], results.get("compile")))
    run_job = fit_verify(job, clock, step_s, ok, bool(layout_change(job, chosen)), ddp_configs(job, chosen) is not None,
                         reserve)
    if beyond_ddp(job) and timed:
        order = measure_in_layout(run_job, rungs, jobs, work, say, device, nnodes * nproc)
    else:
        running = [(r, j) for r, j in zip(rungs, jobs) if r.status == "ok"]
        memory = memory_share.for_device(device, {r.name: j.micro_batch for r, j in running}, job.micro_batch,
                                         results.get("baseline"), memory_share.graph_rungs(
                                             [r for r, _ in running], [j for _, j in running]))
        if memory is not None and timed:
            say(f"memory: {memory.note}")
            plan = asdict(memory)
            if memory.release:
                skipped.append({"what": "every rung bounded to its share of the GPU", "reason": memory.note})
        order = measure_rungs(run_job, rungs, jobs, work, say, memory) if timed else []
    if not timed:
        why = ("no change was adopted: the tuned job is the original" if len(rungs) == 1 else
               "no adopted change can be timed in one process here (" + "; ".join(
                   f"{r.name}: {r.reason}" for r in rungs[1:]) + ")")
        skipped.append({"what": "the staircase", "reason": why})
    staircase.speedups(rungs)
    withdrawn = withdraw_unproven(job, stairs, rungs, chosen)
    if withdrawn and write:
        save_tuned(job, chosen)
    measured = [r for r in rungs if r.wall_s]
    while len(measured) > 1 and measured[-1].name in withdrawn:  # the tuned job stops below a withdrawn top rung
        measured.pop()
    before = measured[0] if measured and measured[0].name == "original" else None
    after = measured[-1] if measured else None
    if after is not None and after.challenger:
        won = bool(after.proven and after.gain > 1)
        after.reason = ("adopted: faster at the tuned precision beyond the noise" if won else
                        "not adopted: not faster than the tuned job beyond the noise")
        if won:
            chosen.append(recheck_change(stairs[-1][1], after))
            if write:
                save_tuned(job, chosen)
        say(f"{after.name}: {after.reason}" + (f" (tuned.yaml: attention: {after.keys['attention']})" if won else ""))
        if not won:
            after = next((r for r in reversed(measured[:-1]) if r.name not in withdrawn), None)
    adopted_n = len(chosen)
    ddp = verify_ddp(run_job, device.type, chosen, work / "ddp", say)  # before the second turn: the share's checks
    if write and len(chosen) > adopted_n:  # the layout check withdrew its proposal: tuned.yaml says so now
        save_tuned(job, chosen)
    for r in rungs:
        r.reason = torchrun_reason(r, ddp)
    stairs_only = list(rungs)
    turn = retime.second_turn(job, run_job, chosen, stairs_only, jobs, before, after, clock, device, work, say,
                              results)
    if turn:
        rungs, order = rungs + turn.pair, order + turn.order
        if turn.not_timed:
            skipped.append({"what": "the tuned file as written, timed again beside the original",
                            "reason": turn.not_timed})
        else:
            before, after = turn.pair
    loss = (staircase.compare_losses(job, before, after) if before else
            {"status": "skipped", "reason": "the original did not run"})
    ledgers = staircase.ledgers(before, after) if before and after and after is not before else {}
    headline = staircase.headline(before, after, stairs_only, loss)
    if turn:
        turn.say_in(headline, after, stairs_only)
    metrics = staircase.metrics(before, after, loss)
    result = VerifyResult("verify", job.to_dict(), environment(device.name, device.type), metrics,
                          [c.to_dict() for c in chosen], str(tuned_path), rungs, order, loss, ledgers, ddp, headline,
                          [], skipped=skipped + clock.shortened)
    result.budget, result.advice, result.memory = clock.record(), advise(result), plan
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def untimed_proposals(job: Job, chosen: list, clock: Clock, step4: dict | None) -> list[dict[str, str]]:
    """A proposed compile mode (step 4's unconfirmed leader) is adopted only once step 7 times it faster; its rung
    compiles cold in a process of its own. When step 7's share cannot hold that compile twice over (the compile
    and the rounds after it), it is withdrawn untimed, and said: the budget never buys a rung it cannot time.
    Returns the skipped entries."""
    left = clock.left_s()
    if left is None:
        return []
    cold, where = cold_compile(job, step4)
    out = []
    for c in [c for c in chosen if c.adopted and c.label == "proposed" and c.key == "compile_mode"]:
        if 2 * cold <= left:
            continue
        why = (f"budget: step 7's share ({left:.0f} s) cannot time a compiled rung, whose cold compile alone takes "
               f"about {cold:.0f} s ({where}); a larger --budget (or none) times it")
        c.adopted, c.reason = False, UNTIMED + why
        out.append({"what": f"proposed change {c.key}: {c.new}", "reason": why})
    return out


UNTIMED = "step 7 could not time it: "  # tuned_file writes "# not adopted: <change>: <reason>"
CLASH = "it clashes with the tuned layout: "
_REVERTS = tuple(zip((UNTIMED, CLASH), tuning.BEFORE_TIMING))  # a reason step 7 left a change out for -> its word


def graphs_clash(job: Job, chosen: list, device_type: str) -> list[dict[str, str]]:
    """A CUDA-graph compile mode (step 4) adopted beside FSDP2 (step 2 or 6) with accumulation: the tuned job's
    layout check would refuse the pair (core.engine.layout_check.graphs_problem), so the compile mode is not
    adopted, and said; where the job's own compile mode clashes too (or the change is pinned by keep), the entry
    says that the tuned file will be refused on CUDA. Returns the skipped entries."""
    problem = graphs_problem(tuning.tuned_job(job, chosen), device_type)
    out = []
    for c in chosen if problem else []:
        if c.adopted and c.key == "compile_mode":
            c.adopted, c.reason = False, f"{CLASH}'{c.new}' {problem.expected}"
            out.append({"what": f"change compile_mode: {c.new}", "reason": c.reason.removeprefix(CLASH)})
    if problem and (still := graphs_problem(tuning.tuned_job(job, chosen), device_type)):
        out.append({"what": "the tuned file on CUDA", "reason": f"its layout check will refuse it: {still}; set "
                    "compile_mode in the job, or keep: [dp_mode]"})
    return out


def untimed_reverts(job: Job, chosen: list) -> list:
    """Step 7's own record of each change it left out before timing (:func:`untimed_proposals`,
    :func:`graphs_clash`): its key back to the job's value, read last by :mod:`mfu_lab.analysis.tuning`
    (``_withdrawn``), so that ``tuned.yaml`` written again from the stored results (the runner's, after step 7)
    does not adopt it."""
    return [tuning.Change(c.rung, "verify", c.key, c.new, getattr(job, c.key), c.reason, c.label,
                          reason=f"{tuning.WITHDRAWN} {word}: {c.reason.removeprefix(prefix)}")
            for c in chosen if not c.adopted for prefix, word in _REVERTS if c.reason.startswith(prefix)]


WITHDRAWN_RUNGS = ("fp8",)  # rungs step 7 withdraws unless it measures them faster (beside every proposed change)


def withdrawable(name: str, mine: list) -> bool:
    """Whether step 7 withdraws rung ``name`` (its changes ``mine``; a rung of rungs climbed as one, "compile + loss",
    by each of its names) unless it measures it faster."""
    return any(n in WITHDRAWN_RUNGS for n in name.split(" + ")) or any(c.label == "proposed" for c in mine)


def withdraw_unproven(job: Job, stairs: list, rungs: list[Rung], chosen: list) -> set[str]:
    """A proposed change (step 4's unconfirmed leader, a guessed loader setting) or an FP8 rung that step 7 did not
    measure faster than the rung below beyond the noise is withdrawn: each of its keys back to the job's value
    (analysis.tuning reads step 7's own changes last, and a change back to the job's value leaves tuned.yaml).
    Returns the names of the rungs withdrawn (the headline and metrics then describe the highest rung kept)."""
    by_name = {name: changes for name, _, changes in stairs}
    done: set[str] = set()
    for rung in rungs[1:]:
        mine = by_name.get(rung.name) or []
        if rung.challenger or not mine or not withdrawable(rung.name, mine):
            continue
        if rung.status == "failed":  # a proposal is adopted once timed faster: a rung that failed was not timed
            why = f"step 7: rung {rung.name} failed ({rung.reason[:200]}): not timed"
        elif rung.status != "ok" or rung.gain is None or (rung.proven and rung.gain > 1):
            continue
        else:
            why = (f"step 7: rung {rung.name} gave {rung.gain:.2f}x [{rung.gain_low:.2f}, {rung.gain_high:.2f}] "
                   "over the rung below, side by side: not faster beyond the noise")
        for c in mine:
            chosen.append(tuning.Change(rung.name, "verify", c.key, c.new, getattr(job, c.key), why, "measured",
                                        reason=f"{tuning.WITHDRAWN}: not verified faster (the staircase's later "
                                        "rungs were measured with it)"))
        done.add(rung.name)
    return done


def advise(r: VerifyResult) -> list[Advice]:
    out: list[Advice] = []
    h = r.headline
    if h.get("speedup") is not None and h.get("proven") and h["speedup"] < 1:
        out.append(Advice("act", f"Keep the original job: the tuned job ({Path(r.tuned_file).name}) measured slower, "
                          f"{h['text']}", "the speedup's whole interval lies below 1.0"))
    elif h.get("speedup") is not None:
        sev = "act" if h.get("proven") and h["speedup"] > 1 and h.get("loss_ok") else "look"
        out.append(Advice(sev, f"Adopt the tuned job ({Path(r.tuned_file).name}): {h['text']}",
                          "changes carried the gain: " + (", ".join(h["carried"]) or "none beyond the noise")))
    gone = {c.rung for c in tuning.withdrawals({"changes": r.changes})}
    layout = {k: r.job.get(k, d) for k, d in (("dp_mode", "ddp"), ("tp", 1), ("pp", 1))}
    in_layout = beyond_ddp(SimpleNamespace(**layout))  # the staircase ran under torchrun, in the job's own layout
    below: list[str] = []  # withdrawn rungs under the one at hand: its gain was measured over their change
    for rung in r.rungs[1:]:
        if rung.name in (retime.AGAIN, retime.AS_WRITTEN):  # the headline's pair: its figure is the headline
            continue
        if rung.status == "ok" and rung.proven is False:
            over = (f"; measured over rung {', '.join(below)}, which step 7 withdrew" + (
                ": the tuned file as written, timed again, is the headline's figure" if h.get("as_written") else "")
                    if below else "")
            out.append(Advice("look", f"The {rung.name} change is not proven on this job: its gain "
                              f"{rung.gain:.2f}x [{rung.gain_low:.2f}, {rung.gain_high:.2f}] includes 1.0",
                              "interleaved rounds, bootstrap interval of the ratio of medians" + over))
        elif rung.status in ("failed", "excluded"):
            out.append(Advice("info" if rung.status == "excluded" else "look",
                              f"Rung {rung.name} {rung.status}: {rung.reason}", "recorded; the other rungs ran"))
        # timed or not (a rung that failed), the rungs above held its change: under torchrun in the job's own layout
        # every key, in one process all but a layout's degrees and DDP settings (a layout through its micro_batch)
        if rung.name in gone and (in_layout or set(rung.keys) - retime.NOT_IN_ONE_PROCESS):
            below.append(rung.name)
    if r.loss.get("status") == "off":
        out.append(Advice("act", "The tuned job's loss ends above the original's beyond loss_tolerance: refuse the "
                          "lossy changes (keep: [dtype, fp8_layers]) and verify again",
                          f"final gap {r.loss['final_gap']:+.2%} (tolerance {r.loss['tolerance']:.0%})"))
    for c in r.changes:
        if not c["adopted"]:
            out.append(Advice("info", f"Not adopted: {c['key']} -> {c['new']!r}: {c['reason']}", c["evidence"]))
    if r.ddp.get("status") == "ok":
        out.append(Advice("info" if r.ddp["proven"] and r.ddp["speedup"] > 1 else "look", r.ddp["text"],
                          "original and tuned DDP configurations alternated in one launch"))
    return out


def save(job: Job, result: VerifyResult) -> Path:
    """Write result.json atomically and refresh the job's index page."""
    return store.save(job, INFO.key, result)
