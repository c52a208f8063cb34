"""The tuned job: every change the steps recommend, as job keys, applied to the original job.

Each step that recommends a change says it in its result; this module reads those results (plain
dicts, as stored) and turns each recommendation into :class:`Change` rows, one per job key, in the
workflow's order (the staircase the verify step measures):

    attention -> communication -> layout -> data -> compile -> precision -> fp8

A change is ``adopted`` (applied to the tuned job), or not, with the reason:

- ``pinned``: the user keeps the key (``keep:`` in the job, ``--keep KEY``);
- ``lossy-unchecked``: it changes the numbers (a compressing DDP hook) and no loss curve was measured
  for it, so it is not adopted (step 2 times hooks, it does not train with them long enough);
- a step that said "keep as is", or a lossy trial that diverged or left the tolerance, produces no
  change at all: there is nothing to adopt.

A result on disk is data, never configuration: each reader may set only the keys its rung owns, by name and type
(:data:`~mfu_lab.analysis.result_keys.MAY_SET`), and a key that names code never comes from a result. Every change
read from a result passes :func:`~mfu_lab.analysis.result_keys.admitted`; one it drops is listed as not adopted, with
why.

Placement on the cluster stays a hint (it is modelled): it is not a key of the tuned job. A layout measured on this
node (step 6's ``layouts``, or step 2's FSDP2 pick) faster beyond the noise is proposed as the ``layout`` rung
(dp_mode, fsdp_*, tp, sp, pp, pp_schedule...), with its measured figures; step 7 verifies it under torchrun.
"""

from __future__ import annotations

from typing import Any

from mfu_lab.analysis.change import JOB_NAME_MAX, RUNGS, TUNED_SUFFIX, Change, tuned_job, tuned_name
from mfu_lab.analysis.dp_family import LOSSY_HOOKS
from mfu_lab.analysis.layouts.proposal import faster_layout
from mfu_lab.analysis.result_keys import admitted
from mfu_lab.analysis.together import BESIDE_LAYOUT, CLASH_REASON, batch_beside_layout, combinable, staircase
from mfu_lab.core.job.schema import FIELDS, Job
from mfu_lab.core.thresholds import DATA_WAIT_LIMIT

# named here too, as callers always have: the change, the tuned job, the staircase and what may stand together
__all__ = ["BEFORE_TIMING", "BESIDE_LAYOUT", "CLASH_REASON", "JOB_NAME_MAX", "RUNGS", "TUNED_SUFFIX", "Change",
           "batch_beside_layout", "changes", "combinable", "in_effect", "settle", "staircase", "tuned_job",
           "tuned_name", "withdrawals"]

# keys that change what a step measured: a result taken with other values is evidence about another job
SHAPE_KEYS = ("model", "model_kwargs", "n_layers", "n_heads", "d_model", "vocab_size", "seq_len", "micro_batch",
              "data", "seq_policy", "device", "dtype", "attention", "compile_mode", "loss_impl", "grad_accum")


def _speed(v: float | None) -> str:
    return f"{v:.2f}x" if v else "speedup not recorded"


def _attention(job: Job, r: dict) -> list[Change]:
    rec = r.get("recommendation") or {}
    new = (rec.get("job_fragment") or {}).get("attention")
    if not new or new == job.attention:
        return []
    row = next((x for x in r.get("attention", []) if x.get("name") == rec.get("attention")), {})
    return [Change("attention", "attention_comm", "attention", job.attention, new,
                   f"step 2: {rec.get('attention')} {_speed(row.get('speedup'))} the job's attention, side by side "
                   "(measured)", "measured")]


def _communication(job: Job, r: dict) -> list[Change]:
    comm = (r.get("recommendation") or {}).get("comm")
    if not comm:
        return []
    if comm.get("kind") == "fsdp":  # step 2 picked an FSDP2 candidate: a layout change, not DDP settings
        return _fsdp_pick(job, r, comm)
    wanted = {"ddp_hook": comm["hook"], "ddp_bucket_mb": float(comm["bucket_cap_mb"]),
              "ddp_grad_as_bucket_view": bool(comm["gradient_as_bucket_view"])}
    rows = {(x.get("hook"), float(x.get("bucket_mb", 0)), x.get("grad_as_bucket_view")): x for x in r.get("comm", [])}
    row = rows.get((comm["hook"], float(comm["bucket_cap_mb"]), comm["gradient_as_bucket_view"]), {})
    step_ms = f"{row['step_median_s'] * 1e3:.1f} ms DDP step" if row.get("step_median_s") else "DDP step"
    out = []
    for key, new in wanted.items():
        if new == getattr(job, key):
            continue
        lossy = key == "ddp_hook" and new in LOSSY_HOOKS
        c = Change("communication", "attention_comm", key, getattr(job, key), new,
                   f"step 2: DDP sweep, {step_ms}, p10-p90 clear of DDP's defaults (measured)", "measured", lossy)
        if lossy:
            c.adopted = False
            c.reason = ("lossy-unchecked: this hook compresses gradients and step 2 measured no loss curve with it; "
                        "set ddp_hook by hand once a training run shows the loss within loss_tolerance")
        out.append(c)
    return out


def _fsdp_pick(job: Job, r: dict, comm: dict) -> list[Change]:
    row = next((x for x in r.get("comm", []) if x.get("hook") == comm.get("hook")), {})
    ref = next((x for x in r.get("comm", []) if x.get("hook") == "none" and float(x.get("bucket_mb", 0)) == 25.0
                and not x.get("grad_as_bucket_view")), {})
    fig = (f"{row['step_median_s'] * 1e3:.1f} ms against DDP's defaults' {ref['step_median_s'] * 1e3:.1f} ms"
           if row.get("step_median_s") and ref.get("step_median_s") else "step time not recorded")
    conf = ((r.get("races") or {}).get("ddp") or {}).get("confirmation") or {}
    if conf.get("speedup") is not None:
        fig += f", confirmed side by side {conf['speedup']:.2f}x [{conf.get('low', 0):.2f}, {conf.get('high', 0):.2f}]"
    gap = f"; final loss {row['loss_gap']:.1e} from DDP's defaults'" if row.get("loss_gap") is not None else ""
    lossy = comm["job_keys"].get("fsdp_reduce_dtype", "float32") not in ("float32", "")
    out = []
    for key, new in comm["job_keys"].items():
        if new == getattr(job, key, None):
            continue
        c = Change("layout", "attention_comm", key, getattr(job, key, None), new,
                   f"step 2: {comm['hook']}, {fig}{gap} (measured)", "measured", lossy)
        if lossy:
            c.reason = (f"reduces gradients in {comm['job_keys']['fsdp_reduce_dtype']}: adopted because step 2's "
                        f"final loss stayed within loss_tolerance ({job.loss_tolerance:.0%}); step 7 checks it again")
        out.append(c)
    return out


def _layout(job: Job, r: dict) -> list[Change]:
    """Step 6: a layout measured on this node, faster beyond the noise than the job's own
    (analysis.layouts.proposal)."""
    found = faster_layout(job, r.get("layouts") or [], (r.get("layouts_run") or {}).get("world"))
    if not found:
        return []
    evidence = (f"step 6: layout {found['layout']} measured on this node, {found['per_sample_s'] * 1e3:.1f} ms per "
                f"sample against the job's own {found['reference']} {found['reference_per_sample_s'] * 1e3:.1f} ms "
                f"({found['speedup']:.2f}x; {found['rule']}); micro_batch scaled to keep the samples per step")
    return [Change("layout", "placement", k, getattr(job, k), v, evidence, "measured")
            for k, v in found["changes"].items()]


def _data(job: Job, r: dict) -> list[Change]:
    data = ((r.get("metrics") or {}).get("data_wait_fraction") or {}).get("value")
    if data is None or data <= DATA_WAIT_LIMIT:
        return []
    why = f"step 1: data wait {data:.1%} of the step (limit {DATA_WAIT_LIMIT:.0%}; measured)"
    race = r.get("loader_race") or {}
    if race.get("adopted"):
        sp = race["speedup"]
        evidence = (f"{why}; step 1's loader race: {race['pick']} {sp['value']:.2f}x [{sp['low']:.2f}, "
                    f"{sp['high']:.2f}] over the job's own loader (measured side by side)")
        return [Change("data", "baseline", k, getattr(job, k, None), v, evidence, "measured")
                for k, v in race["pick_knobs"].items() if getattr(job, k, None) != v]
    if race.get("ran") is False:  # the user's own DataLoader: its knobs are not the job's to change
        return []
    new = 2 if job.num_workers == 0 else job.num_workers * 2
    out = [Change("data", "baseline", "num_workers", job.num_workers, new,
                  why + "; the setting is proposed, the verify step measures what it gives", "proposed")]
    if r.get("environment", {}).get("device_type") == "cuda" and not job.pin_memory:
        out.append(Change("data", "baseline", "pin_memory", False, True, why + "; pinned host batches copy faster",
                          "proposed"))
    return out


def _raced(race: dict) -> str:
    """A side-by-side race's speedup with its interval ("1.20x [1.05, 1.30]")."""
    sp = race.get("speedup") or {}
    return f"{sp.get('value', 0):.2f}x [{sp.get('low', 0):.2f}, {sp.get('high', 0):.2f}]"


def _optimizer(job: Job, r: dict) -> list[Change]:
    """Step 3's optimizer race: AdamW's implementation proven faster side by side (steps.kernels.optimizer_race)."""
    race = r.get("optimizer_race") or {}
    if not race.get("adopted") or race.get("pick") == job.adamw_impl:
        return []
    evidence = (f"step 3's optimizer race: {race['pick']} {_raced(race)} over the job's own "
                f"{race.get('reference')} (measured side by side); {race.get('why', '')}")
    return [Change("optimizer", "kernels", "adamw_impl", job.adamw_impl, race["pick"], evidence, "measured")]


def _batch(job: Job, r: dict) -> list[Change]:
    """Step 3's batch race: a larger micro_batch with a smaller grad_accum, samples per optimizer step held, proven
    faster side by side (steps.kernels.batch_race); with activation checkpointing when that is what made it fit."""
    race = r.get("batch_race") or {}
    if not race.get("adopted"):
        return []
    evidence = (f"step 3's batch race: {race['pick']} (micro_batch x grad_accum) {_raced(race)} over the job's own "
                f"{race.get('reference')}, {race.get('samples_per_step')} samples per optimizer step held (measured "
                "side by side)")
    keys = race.get("pick_keys") or {}
    return [Change("batch", "kernels", k, getattr(job, k, None), v, evidence, "measured")
            for k, v in keys.items() if getattr(job, k, None) != v]


def _loss(job: Job, r: dict) -> list[Change]:
    """Step 4's loss race: the default cross-entropy's implementation proven faster side by side
    (steps.compile.loss_race), in the mode the job trains in after step 4."""
    race = r.get("loss_race") or {}
    if not race.get("adopted") or race.get("pick") == job.loss_impl:
        return []
    evidence = (f"step 4's loss race (mode {race.get('mode')}): {race['pick']} {_raced(race)} over the job's own "
                f"{race.get('reference')} (measured side by side), final loss within {race.get('final_gap', 0):.2%}")
    return [Change("loss", "compile", "loss_impl", job.loss_impl, race["pick"], evidence, "measured")]


def _compile(job: Job, r: dict) -> list[Change]:
    rec = r.get("recommendation") or {}
    led = rec.get("led")
    if not rec.get("compile") and led and led != job.compile_mode:  # a leader its confirmation did not prove
        trial = next((t for t in r.get("trials", []) if t.get("mode") == led), {})
        return [Change("compile", "compile", "compile_mode", job.compile_mode, led,
                       f"step 4: mode {led} led the trials ({_speed(trial.get('speedup'))} eager) but its "
                       "confirmation beside eager did not prove it; proposed: step 7 times it side by side and "
                       "withdraws it unless it is faster there", "proposed")]
    if not rec.get("compile") or rec.get("mode") == job.compile_mode:
        return []
    trial = next((t for t in r.get("trials", []) if t.get("mode") == rec["mode"]), {})
    pays = (f", pays back its compile after {rec['break_even_cold']:.0f} steps"
            if rec.get("break_even_cold") is not None else "")
    out = [Change("compile", "compile", "compile_mode", job.compile_mode, rec["mode"],
                  f"step 4: {_speed(trial.get('speedup'))} eager, each in a fresh process (measured){pays}",
                  "measured")]
    if rec.get("shapes_first") and job.seq_policy == "longest":  # shapes first: a few lengths, few recompiles
        shapes = len((r.get("audit") or {}).get("shapes") or {})
        out.insert(0, Change("compile", "compile", "seq_policy", job.seq_policy, "bucket",
                             f"step 4: {shapes or 'several'} batch shapes in one epoch make the compiled model "
                             f"recompile; bucketing to seq_buckets ({job.seq_buckets}) lengths bounds them "
                             "(proposed; the verify step measures it with the compile mode)", "proposed"))
    return out


def _precision(job: Job, r: dict) -> list[Change]:
    choice = (r.get("precision") or {}).get("choice") or {}
    if not choice.get("adopted"):
        return []
    ci = ""
    if choice.get("speedup_low") is not None:
        ci = f" [{choice['speedup_low']:.2f}, {choice['speedup_high']:.2f}]"
    ref = (r.get("precision") or {}).get("reference") or "float32"  # under a budget: the job's own precision
    gap = f", final loss {choice['final_gap']:+.2%} from {ref}" if choice.get("final_gap") is not None else ""
    evidence = (f"step 5: {choice.get('rung')} {_speed(choice.get('speedup'))}{ci} over {ref}, side by side{gap} "
                f"(within loss_tolerance {job.loss_tolerance:.0%}; measured)")
    out = []
    for key in ("dtype", "matmul_precision"):
        if choice.get(key) and choice[key] != getattr(job, key):
            out.append(Change("precision", "fp8", key, getattr(job, key), choice[key], evidence, "measured", True))
    return out


EMULATED_FP8 = "FP8 emulated on this device (numerics only)"  # how such a change's reason begins


def _fp8(job: Job, r: dict) -> list[Change]:
    choice = r.get("choice") or {}
    groups = choice.get("groups") or []
    if not groups:
        return []
    emulated = r.get("path") == "emulated"
    label = "emulated" if emulated else "measured"
    gap = f", final loss gap {r['metrics']['chosen_final_gap']['value']:+.2%}" if (
        (r.get("metrics") or {}).get("chosen_final_gap", {}).get("value") is not None) else ""
    evidence = (f"step 5: loss within fp8_tolerance over the trial{gap} ({label})"
                + ("; FP8 numerics only: this device has no FP8 units, no speed is claimed" if emulated else ""))
    speed = r.get("speed") or {}
    slower = ""  # FP8 only where it is faster: torchao's real speed, when measured, gates the policy
    if emulated:  # a change is worth what it measurably gives: here no FP8 layer can train, so nothing to time
        slower = (f"{EMULATED_FP8}: set it on a GPU with FP8 units (capability 8.9+, torchao), where step 5 times "
                  "each group in FP8 and adopts the ones faster than bf16")
    elif speed.get("status") not in ("ok", "slower"):  # FP8 units, but no timing (torchao missing, failed, budget)
        slower = (f"FP8's speed was not measured here ({speed.get('reason') or speed.get('status') or 'not timed'})"
                  ": not adopted until step 5 times it faster than bf16")
    kept, dropped = speed.get("groups_kept"), speed.get("groups_dropped") or {}
    if isinstance(kept, list) and dropped:  # each group probed on its own shapes (steps.fp8.group_speed)
        groups = [g for g in groups if g in kept]
        evidence += "; left out, not faster in FP8 on their own shapes: " + "; ".join(
            f"{g} ({w})" for g, w in dropped.items())
    if speed.get("status") == "slower" or not groups:
        slower = f"measured per group: {speed.get('reason') or 'no group faster in FP8'}; not adopted"
        groups = groups or list(choice.get("groups") or [])
    elif speed.get("status") == "ok" and isinstance(speed.get("speedup"), int | float) and speed["speedup"] <= 1.0:
        slower = (f"measured {speed['speedup']:.2f}x of bf16 (torchao {speed.get('recipe') or ''} against the same "
                  "model without it, both compiled): not faster, so not adopted")
    out = []
    if sorted(groups) != sorted(job.fp8_layers):
        out.append(Change("fp8", "fp8", "fp8_layers", list(job.fp8_layers), list(groups), evidence, label, True,
                          adopted=not slower, reason=slower))
    if choice.get("recipe") and choice["recipe"] != job.fp8_recipe:
        out.append(Change("fp8", "fp8", "fp8_recipe", job.fp8_recipe, choice["recipe"], evidence, label, True,
                          adopted=not slower, reason=slower))
    return out


WITHDRAWN = "withdrawn"  # how a reason begins when step 7 takes a key back to the job's value
# step 7's words for a change it left out before timing (steps.verify.step: "withdrawn untimed: ...", a change
# its budget could not time; "withdrawn clash: ...", a compile mode beside the tuned layout)
BEFORE_TIMING = ("untimed", "clash")
_EARLY = tuple(f"{WITHDRAWN} {w}:" for w in BEFORE_TIMING)  # how such a revert's reason begins
# how a reason may begin in a stored result of step 7 that took something back: results before 2026-12-08 wrote a
# withdrawn layout's as "the proposed layout is withdrawn: ..."
_TOOK_BACK = (WITHDRAWN, "the proposed layout is withdrawn")


def _verify_rows(r: dict, withdrawals: bool) -> list[Change]:
    """Changes step 7 itself adopted, its withdrawals or the others; fields as text where they are text, whatever
    the file holds."""
    rows = r.get("changes")
    return [Change(str(c.get("rung", "")), "verify", c.get("key"), c.get("old"), c.get("new"),
                   str(c.get("evidence", "")), str(c.get("label", "")), c.get("lossy") is True,
                   reason=str(c.get("reason", "")))
            for c in (rows if isinstance(rows, list) else []) if isinstance(c, dict)
            and c.get("step") == "verify" and c.get("adopted") is True
            and str(c.get("reason", "")).startswith(_TOOK_BACK) == withdrawals]


def _rechecked(job: Job, r: dict) -> list[Change]:
    """Changes step 7 itself adopted: an earlier choice timed again at the tuned precision, and faster (step 2's
    attention)."""
    return _verify_rows(r, False)


def withdrawals(r: dict) -> list[Change]:
    """Step 7's withdrawals in its result ``r`` (a dict as stored): a proposed change or FP8 rung not measured
    faster, or one it could not time or adopt, back to the job's value."""
    return _verify_rows(r, True)


def _withdrawn(job: Job, r: dict) -> list[Change]:
    """Step 7's withdrawals (read last, they replace the change of their key: the runner's tuned.yaml after step 7
    holds what step 7 decided)."""
    return withdrawals(r)


# (the step whose result is read, the reader's row in result_keys.MAY_SET, the reader)
READERS = (("attention_comm", "attention", _attention), ("attention_comm", "communication", _communication),
           ("placement", "layout", _layout), ("baseline", "data", _data), ("kernels", "optimizer", _optimizer),
           ("kernels", "batch", _batch),
           ("compile", "compile", _compile), ("compile", "loss", _loss),
           ("fp8", "precision", _precision), ("fp8", "fp8", _fp8), ("verify", "rechecked", _rechecked),
           ("verify", "withdrawn", _withdrawn))


def changes(job: Job, results: dict[str, dict], keep: list[str] | tuple[str, ...] = ()) -> list[Change]:
    """Every recommended change, in the staircase's order, from the steps' stored results (key -> dict).
    A ``verify`` result adds the changes step 7 adopted itself (they come last, and replace an earlier change of
    the same key).

    ``keep`` (with the job's own ``keep:``) pins keys: their changes are listed, not adopted.
    """
    pinned = set(job.keep) | set(keep)
    unknown = sorted(pinned - set(FIELDS))
    if unknown:
        raise ValueError(f"--keep {', '.join(unknown)}: not a job key")
    out: list[Change] = []
    refused: list[Change] = []  # listed after the others: a refused change of step 7 replaces no earlier one
    for step, reader, read in READERS:
        r = results.get(step)
        if not r:
            continue
        found, dropped = admitted(reader, read(job, r))
        refused += dropped
        if step == "placement" and found:  # step 6 compared every layout that fits: its pick replaces step 2's
            out = [o for o in out if o.rung != "layout"]
        measured_with = {k: v for k, v in (r.get("job") or {}).items()
                         if k in SHAPE_KEYS and v != getattr(job, k)}
        for c in found:
            if measured_with:
                c.evidence += "; measured with " + ", ".join(f"{k}={v!r} (this job: {getattr(job, k)!r})"
                                                            for k, v in measured_with.items())
            if c.key in pinned:
                c.adopted, c.reason = False, "pinned: kept at the job's value (keep)"
            out.append(c)
    return settle(job, out) + refused


def settle(job: Job, found: list[Change]) -> list[Change]:
    """The changes read from the results (``found``, in the staircase's order, step 7's own last) as they stand, in
    step 7's own order: the steps' changes as step 7 found them (step 3's split beside a layout,
    :func:`~mfu_lab.analysis.together.batch_beside_layout`, then what cannot stand together,
    :func:`~mfu_lab.analysis.together.combinable`), then what step 7 left out before timing (its reverts of
    :data:`BEFORE_TIMING`) and its guard, then its re-checks and withdrawals after timing (:func:`in_effect`). A
    change left out before step 7 ran was not timed: a withdrawal that made room for it does not bring it back. What
    is left still passes :func:`~mfu_lab.analysis.together.combinable` (it only leaves out)."""
    steps = combinable(job, batch_beside_layout([c for c in found if c.step != "verify"]))
    rows = [c for c in found if c.step == "verify"]
    if not rows:  # step 7 has not run: nothing of its own to replay
        return steps
    early = [c for c in rows if c.reason.startswith(_EARLY)]
    timed = combinable(job, in_effect(steps + early, job.to_dict()))  # step 7's guard, after its leaving-out
    return combinable(job, in_effect(timed + [c for c in rows if not any(c is e for e in early)], job.to_dict()))


def in_effect(chosen: list[Change], job_values: dict[str, Any]) -> list[Change]:
    """The changes that stand, in order: a change step 7 made itself (``step == "verify"``: a choice timed again,
    or a proposed layout withdrawn) replaces every earlier change of its key, and one back to the job's own value
    (``job_values``) leaves nothing to change. :func:`changes` and the index's summary both read this, so the
    summary counts what ``tuned.yaml`` holds."""
    out: list[Change] = []
    for c in chosen:
        if c.step == "verify":
            out = [o for o in out if o.key != c.key]
            if c.key in job_values and c.new == job_values[c.key]:
                continue
        out.append(c)
    return out
