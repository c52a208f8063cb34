"""Step 2's DDP sweep as a race (:mod:`mfu_lab.analysis.racing`): every configuration the backend accepts is timed
for ``race_steps`` steps, then the survivors (DDP's default and the job's own configuration always among them) are
measured in full (timed steps, a profiled step, the sync check, the same steps under no_sync) side by side, in the
same launch: the worker picks them by :func:`mfu_lab.analysis.racing.finalists`, so the race pays one start-up
(after a crash or hang, the relaunch screens what is left and the finalists get a launch of their own).
``thorough`` measures every configuration in full in one launch.

The references go first, in full, and DDP's default bounds the rest: when its steps with no communication at all
(no_sync) are within the race's noise band of its steps with it, no bucket size, hook or bucket view can be picked
over it (:func:`mfu_lab.analysis.racing.exposure_bound`), and only the FSDP2 candidates are screened.

Configurations the backend is known to refuse (:func:`mfu_lab.workers.comm_configs.known_refusal`) are recorded as
unsupported without a launch, in both modes. In both modes, a configuration the step would pick over DDP's default
is then confirmed (:func:`confirm_pick`): the two alternate, in the sweep's own launch when the worker made the
same pick (it applies the step's rule to the same figures), else in a launch of their own; the pick stands only
when its speedup's bootstrap interval lies above 1.0 (:func:`mfu_lab.analysis.racing.confirm`).
"""

from __future__ import annotations

import time
from pathlib import Path

from mfu_lab.analysis import racing
from mfu_lab.core.engine.layout import beyond_ddp
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process.budget import Clock, fit_count, job_step_s
from mfu_lab.core.store import step_results as store
from mfu_lab.core.thresholds import RACE_CONFIRM_TURNS
from mfu_lab.workers.alternate import alternate, turn_lines
from mfu_lab.workers.comm_configs import config_key, config_name, hook_of, is_fsdp, known_refusal, screened_configs
from mfu_lab.workers.ddp_rank import ddp_warmup
from mfu_lab.workers.launch import SweepOutcome, full_factor, run_sweep, world_layout

name = config_name  # hook/bucketMB/view or copy, as the race and the report name a configuration


def job_config(job: Job) -> dict:
    return {"hook": job.ddp_hook, "bucket_mb": job.ddp_bucket_mb, "grad_as_bucket_view": job.ddp_grad_as_bucket_view}


def layout_beyond_ddp(job: Job) -> str:
    """Why step 2's DDP race does not apply to the job ('' when it does): a job trained with FSDP, tensor or
    pipeline parallel does not communicate through DDP's buckets and hooks."""
    if not beyond_ddp(job):
        return ""
    what = ", ".join(x for x in ("FSDP2" if job.dp_mode == "fsdp" else "", f"tp {job.tp}" if job.tp > 1 else "",
                                 f"pp {job.pp}" if job.pp > 1 else "") if x)
    return (f"the job trains in its own layout ({what}), which does not communicate through DDP's buckets and "
            "hooks: DDP's settings are not raced; step 1 measures the layout's collectives, and racing layouts "
            "against each other is step 6's (the issue 'Layouts raced')")


ONE_RANK = "world size 1: no gradient communication to tune"


def one_rank_skip(nnodes: int, nproc: int, device_type: str) -> str:
    """Why step 2 runs no DDP half at world size 1 (nothing launched, nothing timed), and how to run it where there
    is gradient communication."""
    where = ("this node shows one GPU" if device_type == "cuda" and nproc == 1 and nnodes == 1 else
             f"nnodes x nproc_per_node = {nnodes} x {nproc}")
    return (f"{ONE_RANK} ({where}): no rank exchanges gradients, so the DDP sweep, its FSDP2 candidates and the "
            "all-reduce benchmark are not run and none of step 2's share is held back for them. To tune "
            "communication, run step 2 with 2 or more ranks: a node with 2 or more GPUs (nproc_per_node: 0 takes "
            "every visible GPU), nproc_per_node: 2 on a CPU, or nnodes: N (README, 'On a GPU node, and across "
            "nodes')")


def ddp_half_runs(job: Job, device_type: str) -> tuple[bool, str]:
    """(whether step 2's DDP half runs, why not): not at world size 1 (:func:`one_rank_skip`), nor for a job that
    does not communicate through DDP's buckets and hooks (:func:`layout_beyond_ddp`). The attention half then
    plans with the whole of step 2's share (:func:`mfu_lab.steps.attention_comm.attention_race.attention_section`)."""
    nnodes, nproc = world_layout(job, device_type)
    if nnodes * nproc < 2:
        return False, one_rank_skip(nnodes, nproc, device_type)
    beyond = layout_beyond_ddp(job)
    return not beyond, beyond


def skipped_sweep(job: Job, device_type: str, why: str) -> SweepOutcome:
    """The DDP half's record at world size 1: the layout and why nothing ran; no configuration, no launch, no
    figure."""
    nnodes, nproc = world_layout(job, device_type)
    return SweepOutcome({"nnodes": nnodes, "nproc_per_node": nproc, "world_size": nnodes * nproc,
                         "backend": "nccl" if device_type == "cuda" else "gloo", "skipped": why}, [])


SCREEN_SHARE = 0.5  # under a budget the first round gets at most half the time left (then: finals, confirmation)


def screen_fit(job: Job, runnable: list[dict], refs: list[str], clock: Clock) -> tuple[list[dict], list[tuple]]:
    """(the configurations the first round screens, [(configuration, why not)]) within the budget: the
    references, then the others in their order, as many as fit :data:`SCREEN_SHARE` of the time left at about
    (``comm_warmup_steps`` + ``race_steps`` + 1 for the re-wrap) steps each on ranks of one thread (2 x the job's
    step as step 1 measured it), after a launch of about 10 s and the references' full measurements (2 x
    (``comm_warmup_steps`` + ``comm_steps``) + 1 steps each: synced, profiled, no_sync)."""
    left = clock.left_s()
    if left is None:
        return runnable, []
    step_s, where = job_step_s(store.earlier(job, "baseline").data)
    each = (job.comm_warmup_steps + job.race_steps + 1) * 2 * step_s
    ref_s = len(refs) * (2 * (job.comm_warmup_steps + job.comm_steps) + 1) * 2 * step_s
    keep = len(refs) + fit_count(left * SCREEN_SHARE, len(runnable) - len(refs), each, fixed_s=10.0 + ref_s,
                                 least=0)
    ordered = [c for c in runnable if name(c) in refs] + [c for c in runnable if name(c) not in refs]
    if keep >= len(ordered):
        return runnable, []
    why = (f"budget: not screened ({left * SCREEN_SHARE:.0f} s, half of step 2's {left:.0f} s left, holds {keep} of "
           f"{len(ordered)}: the references in full, about {ref_s:.0f} s, then about {each:.1f} s each: {where})")
    clock.shorten("DDP first round", why.removeprefix("budget: "))
    return ordered[:keep], [(c, why) for c in ordered[keep:]]


def race_ddp(job: Job, device_type: str, attention: str | None, work: Path, on_event, grad_bytes: int,
             reference: tuple, clock: Clock, fault: dict | list | None = None) -> tuple[SweepOutcome, racing.RaceLog,
                                                                                   list[dict]]:
    """(the sweep's outcomes, how it ran, the configurations in the order the report lists them); ``fault``: tests
    only, passed to the first launch (:func:`mfu_lab.workers.launch.run_sweep`)."""
    nnodes, nproc = world_layout(job, device_type)
    backend = "nccl" if device_type == "cuda" else "gloo"
    own = job_config(job)
    configs = screened_configs(job, own)  # the job's own configuration is always in the race
    refused = {config_key(c): why for c in configs if (why := known_refusal(c, backend, grad_bytes))}
    runnable = [c for c in configs if config_key(c) not in refused]
    refs = [name(c) for c in runnable if config_key(c) in (reference, config_key(own))]
    ref_name = next((name(c) for c in runnable if config_key(c) == reference), None)
    left = clock.left_s()
    deadline = None if left is None else time.time() + left
    confirm = {"reference": ref_name, "turns": RACE_CONFIRM_TURNS, "deadline": deadline,
               "loss_tolerance": job.loss_tolerance} if ref_name else None  # the pick obeys step 2's loss check
    log = racing.RaceLog("exhaustive" if job.thorough else "racing", refs)
    by_name = {name(c): c for c in runnable}

    def finish(sweep: SweepOutcome) -> SweepOutcome:
        for c in configs:
            if config_key(c) in refused:
                ev = {"event": "unsupported", "config": c, "error": refused[config_key(c)]}
                sweep.outcomes[config_key(c)] = ev
                on_event(ev)
        return sweep

    beyond = layout_beyond_ddp(job)
    if beyond:  # FSDP, TP or PP: DDP's buckets and hooks are not how this job communicates
        sweep = SweepOutcome({"nnodes": nnodes, "nproc_per_node": nproc, "world_size": nnodes * nproc,
                              "backend": backend, "skipped": beyond}, [])
        for c in runnable:
            sweep.outcomes[config_key(c)] = ev = {"event": "skipped", "config": c, "error": beyond}
            on_event(ev)
        log.note = "not raced: " + beyond
        return finish(sweep), log, configs
    if job.thorough or nnodes * nproc < 2 or len(runnable) <= 2:
        t0 = time.perf_counter()
        sweep = run_sweep(job, device_type, attention, work, on_event, configs=runnable, confirm=confirm,
                          fault=fault)
        done = {name(c): (sweep.outcomes.get(config_key(c)) or {}).get("wall_s") or [] for c in runnable}
        log.rounds.append(racing.log_round(1, job.comm_steps, done, list(done), {}, time.perf_counter() - t0))
        if not job.thorough:
            log.note = "nothing to race: " + ("one rank" if nnodes * nproc < 2 else "two configurations or fewer")
        return finish(sweep), log, configs

    runnable, unscreened = screen_fit(job, runnable, refs, clock)
    t0 = time.perf_counter()
    sweep = run_sweep(job, device_type, attention, work, on_event, configs=runnable, screen=job.race_steps,
                      race={"references": refs, "deadline": deadline, "bound": ref_name}, confirm=confirm,
                      fault=fault)
    first = {k: sweep.outcomes.get(k) if name(c) in refs else sweep.screened.get(k)  # references: in full, first
             for c in runnable for k in [config_key(c)]}
    samples = {name(c): (first[config_key(c)] or {}).get("wall_s") or [] for c in runnable}
    decided = {r.get("number"): r for r in sweep.rounds}
    ruled = {name(ev["config"]): ev["error"] for ev in sweep.outcomes.values() if ev.get("event") == "dropped"}
    if 1 in decided:  # the worker raced inside its launch: its decision, by the same rule
        kept, dropped, cut, spent = decided[1]["kept"], decided[1]["dropped"], decided[1]["cut"], decided[1]["seconds"]
    else:  # a relaunch screened the rest: decide here
        spent = time.perf_counter() - t0
        full = {name(c) for c in runnable if (sweep.outcomes.get(config_key(c)) or {}).get("event") == "done"
                and not sweep.outcomes[config_key(c)].get("screen")}
        kept, dropped, cut = racing.finalists(samples, refs, spent, full_factor(job), clock.left_s(), measured=full)
        dropped = dropped | ruled
    # the worker's exposure bound: in its round (it may have had nothing left to rule out), else in what it ruled
    bound = (decided.get(1) or {}).get("bound") or next(iter(ruled.values()), "")
    if bound:  # the budget's cut, too, could not have been picked: said with the measured reason
        unscreened = [(c, why if is_fsdp(c) else f"{bound}; the budget left it out as well") for c, why in unscreened]
        n = len(ruled) + sum(not is_fsdp(c) for c, _ in unscreened)
        log.note = f"{n} DDP configuration(s) not screened: {bound}"
    for c, why in unscreened:
        sweep.outcomes[config_key(c)] = ev = {"event": "skipped", "config": c, "error": why}
        on_event(ev)
    if cut:
        clock.shorten("DDP final round", f"{len(cut)} configuration(s) inside the noise band not measured in full "
                      f"({', '.join(cut)}); the leader and the references were")
    log.rounds.append(racing.log_round(1, job.race_steps, samples, kept, dropped, spent))
    t1 = time.perf_counter()
    todo = [k for k in kept if (sweep.outcomes.get(config_key(by_name[k])) or {}).get("screen")]
    if todo and nnodes > 1:  # each node would decide on its own figures: no launch the others might not join
        for k in todo:
            sweep.outcomes[config_key(by_name[k])] = dict(
                sweep.outcomes[config_key(by_name[k])], event="failed", error="several nodes: the racing launch "
                "ended before measuring this finalist, and one node cannot start a launch the others would not join")
        todo = []
    if todo:  # finalists not measured in full in the first launch (it raced no final round, or ended early)
        more = run_sweep(job, device_type, attention, work, on_event, configs=[by_name[k] for k in todo],
                         allreduce=False)
        sweep.outcomes.update(more.outcomes)
        sweep.launches += more.launches
    full = {k: (sweep.outcomes.get(config_key(by_name[k])) or {}).get("wall_s") or [] for k in kept}
    final_s = (decided[2]["seconds"] if 2 in decided else 0.0) + (time.perf_counter() - t1 if todo else 0.0)
    log.rounds.append(racing.log_round(2, job.comm_steps, full, kept, {}, final_s))
    for k, why in dropped.items():  # dropped configurations keep their screening figures, marked as such
        ev = dict(sweep.screened.get(config_key(by_name[k])) or {}, event="dropped", config=by_name[k], error=why)
        sweep.outcomes[config_key(by_name[k])] = ev
    for c in runnable:  # screened, then neither dropped nor measured in full: the final round ended before it
        ev = sweep.outcomes.get(config_key(c))
        if ev and ev.get("screen") and ev["event"] == "done":
            sweep.outcomes[config_key(c)] = dict(ev, event="failed",
                                                 error="screened, but the final round's launch ended before it")
    return finish(sweep), log, configs


def confirm_pick(job: Job, device_type: str, attention: str | None, sweep: SweepOutcome, reference: dict,
                 pick: dict, work: Path, clock: Clock, step_s: float, progress=None) -> racing.Confirmation:
    """``pick`` measured again beside ``reference``, alternating ``RACE_CONFIRM_TURNS`` times (timed steps only).

    The sweep's own launch confirms its pick in most runs (the worker applies the step's rule to the same figures):
    those turns are taken as they are. Otherwise (the worker's pick differed, its turns were cut short by a crash
    or a hang) the two alternate in a launch of their own, estimated by
    :func:`mfu_lab.analysis.racing.confirm_seconds` at ``step_s``, the slower one's median step."""
    ref_name, pick_name = name(reference), name(pick)
    done = sweep.confirm or {}
    if done.get("candidate") == pick_name and done.get("reference") == ref_name:
        if done.get("skipped"):
            return _skipped(clock, pick_name, ref_name, done["skipped"])
        if done.get("done"):
            walls = {k: [w for ev in sweep.turns if name(ev["config"]) == k for w in ev["wall_s"]]
                     for k in (ref_name, pick_name)}
            return racing.confirm(pick_name, ref_name, walls[ref_name], walls[pick_name], done["turns"],
                                  job.comm_steps, [name(ev["config"]) for ev in sweep.turns], done.get("seconds"))
    turns = RACE_CONFIRM_TURNS
    if world_layout(job, device_type)[0] > 1:  # every node's launcher would have to start the same launch
        return racing.Confirmation(pick_name, ref_name, "skipped", "several nodes: the sweep's own launch ended "
                                   "before it confirmed this pick, and one node cannot start a launch the others "
                                   "would not join")
    warm = max(ddp_warmup(job.comm_warmup_steps, hook_of(c)) for c in (reference, pick))  # as the worker warms up
    estimate = racing.confirm_seconds(turns, warm + job.comm_steps, step_s)
    if not clock.fits(estimate):
        return _skipped(clock, pick_name, ref_name, f"budget: {clock.left_s():.0f} s of the step's share left, the "
                        f"confirmation needs about {estimate:.0f} s")
    run = alternate(job, device_type, attention, [reference, pick], turns, work / "confirm",
                    turn_lines(progress or (lambda msg: None), "confirmation turns", 2 * turns))
    if run.error:
        return racing.Confirmation(pick_name, ref_name, "failed", run.error, turns, job.comm_steps,
                                   seconds=run.seconds)
    names = {config_key(reference): ref_name, config_key(pick): pick_name}
    return racing.confirm(pick_name, ref_name, run.walls[config_key(reference)], run.walls[config_key(pick)],
                          turns, job.comm_steps, [names[k] for k in run.order], run.seconds)


def _skipped(clock: Clock, pick: str, reference: str, why: str) -> racing.Confirmation:
    """A confirmation the budget left out: said in the step's record, and the default stays."""
    clock.shorten("DDP confirmation", f"{pick} not measured again beside {reference} "
                  f"({why.removeprefix('budget: ')}); the default stays")  # shorten() says "budget:" itself
    return racing.Confirmation(pick, reference, "skipped", why)
