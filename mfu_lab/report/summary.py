"""The job's story across steps, for the summary page: where MFU started, what each step found worth
changing and what that change measured, every recommendation in one list, the ledger before and after.

Pure functions of the steps' result dicts (``mfu_lab.core.store.files.load_results``), so they are tested on stored
results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mfu_lab.analysis import tuning
from mfu_lab.core.job import overrides as ov
from mfu_lab.core.measure.ledger import upgrade
from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.report.gains import comm_gain, ordered


@dataclass
class Change:
    """One change a step measured: what, its gain, the gain's label, and whether the job already has it."""

    step: str  # step folder, e.g. 02_attention_and_comm
    change: str
    gain: float | None  # x (speedup) or fraction, see unit
    unit: str  # "x" | "fraction"
    source: str  # the gain's label: measured | emulated | modelled
    status: str  # adopt | in the job | keep as is | not measured
    how: str  # how the gain was obtained / how to adopt it (job-file fragment)


def changes(results: dict[str, dict[str, Any]]) -> list[Change]:
    """Every change the steps that ran measured, in workbook order."""
    out: list[Change] = []
    if "attention_comm" in results:
        d, folder = results["attention_comm"], BY_KEY["attention_comm"].folder
        rec, m, job = d.get("recommendation", {}), d.get("metrics", {}), d.get("job", {})
        frag = rec.get("job_fragment") or {}
        speed = (m.get("attention_speedup") or {}).get("value")
        if frag:
            have = all(job.get(k) == v for k, v in frag.items())
            out.append(Change(folder, f"attention: {rec.get('attention')}", speed, "x", "measured",
                              "in the job" if have else "adopt",
                              "job file: " + ", ".join(f"{k}: {v}" for k, v in frag.items())
                              + "; step time against the job's own attention, side by side"))
        elif rec.get("attention_text"):
            out.append(Change(folder, "attention: keep the job's own", speed, "x", "measured", "keep as is",
                              rec["attention_text"]))
        comm = rec.get("comm")
        if comm:
            gain = comm_gain(d)
            is_default = (comm.get("hook"), comm.get("bucket_cap_mb"), bool(comm.get("gradient_as_bucket_view"))) \
                == ("none", 25, False)
            what = (f"FSDP2 instead of DDP: {comm.get('hook')}" if comm.get("kind") == "fsdp" else
                    f"DDP: hook {comm.get('hook')}, bucket_cap_mb {comm.get('bucket_cap_mb')}, "
                    f"gradient_as_bucket_view {comm.get('gradient_as_bucket_view')}")
            keep = comm["keep"] if isinstance(comm.get("keep"), bool) else is_default  # the job's own won
            out.append(Change(folder, what, gain, "x", "measured",
                              "keep as is" if keep else "adopt",
                              "DDP step time of DDP's defaults / this configuration's, in one launch; "
                              + rec.get("comm_text", "")))
    if "compile" in results:
        d, folder = results["compile"], BY_KEY["compile"].folder
        rec, m = d.get("recommendation", {}), d.get("metrics", {})
        sp = (m.get("speedup") or {}).get("value")
        if rec.get("compile"):
            out.append(Change(folder, f"torch.compile, mode {rec.get('mode')}", sp, "x", "measured", "adopt",
                              rec.get("text", "")))
        else:
            out.append(Change(folder, "torch.compile: stay eager", sp, "x", "measured", "keep as is",
                              rec.get("text", "")))
    if "fp8" in results:
        d, folder = results["fp8"], BY_KEY["fp8"].folder
        ch, sp, job = d.get("choice") or {}, d.get("speed") or {}, d.get("job", {})
        if ch.get("groups"):
            have = sorted(job.get("fp8_layers") or []) == sorted(ch["groups"])
            what = f"FP8: {ch.get('policy')} ({ch.get('recipe')})"
            if sp.get("status") == "ok" and sp.get("speedup"):  # analysis.tuning adopts it only when faster
                out.append(Change(folder, what, sp["speedup"], "x", "measured",
                                  "in the job" if have else "adopt" if sp["speedup"] > 1 else "keep as is",
                                  "bf16 step / fp8 step, both compiled (torchao); " + ch.get("fragment", "")))
            elif sp.get("status") == "slower":  # no group faster in FP8 on its own shapes: not adopted
                out.append(Change(folder, what, None, "x", "measured", "in the job" if have else "keep as is",
                                  (sp.get("reason") or "no group faster in FP8") + "; " + ch.get("fragment", "")))
            else:  # emulated (no FP8 units), or FP8's speed not measured here: not adopted (analysis.tuning)
                emulated = d.get("path") == "emulated"
                out.append(Change(folder, what, ch.get("flops_share"), "fraction", "emulated" if emulated else
                                  "analytic", "in the job" if have else "not measured",
                                  "share of linear-layer FLOPs in FP8, loss kept" + (" in emulation" if emulated
                                                                                      else "") + "; no speed measured ("
                                  + (sp.get("reason") or "no FP8 hardware") + "); " + ch.get("fragment", "")))
        else:
            out.append(Change(folder, "FP8: no policy kept the loss", None, "fraction", "emulated", "keep as is",
                              ch.get("text", "")))
    if "placement" in results:
        d, folder = results["placement"], BY_KEY["placement"].folder
        c, strategies = d.get("chosen"), d.get("strategies", [])
        if c:
            worst = max((s.get("vs_aware") or 1.0 for s in strategies if s.get("status") == "ok"), default=None)
            n = len(c.get("gpus") or [])
            out.append(Change(folder, f"placement: {n} GPUs as {c.get('label', '')}, topology-aware, "
                              f"predicted MFU {c.get('mfu', 0):.1%}",
                              worst, "x", "modelled", "adopt",
                              "predicted step time of the worst other placement / topology-aware's, on "
                              f"{d.get('cluster', {}).get('name', 'the cluster file')}; see the Slurm / Kueue hints"))
    return out


def recommendations(results: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every step's advice as (step folder, advice with its estimated ``gain``), the largest estimated gain first
    (:func:`mfu_lab.report.gains.ordered`)."""
    return ordered(results)


# What each step's MFU bar measures (the summary chart's x labels and legend).
BAR_MEANING = {"baseline": "the job as it came, one process, eager",
               "attention_comm": "recommended attention, one process, eager",
               "kernels": "unprofiled steps, one process, eager",
               "compile": "recommended mode (or eager), one process",
               "verify": "the tuned job, one process, side by side with the original"}


def the_job(result: dict[str, Any] | None) -> str:
    """"the job as it came", or "the job with -p micro_batch=16" when the result was measured with command-line
    overrides that change the job (:func:`mfu_lab.core.job.overrides.workload`)."""
    changed = ov.workload(ov.recorded(result))
    return f"the job with {ov.flags(changed)}" if changed else "the job as it came"


def overrides_line(results: dict[str, dict[str, Any]]) -> list[str]:
    """One sentence naming every step whose result was measured with command-line overrides, and them: steps with
    the same overrides (one run's, as a rule) are named together, the overrides once."""
    groups: dict[str, list[int]] = {}
    for info in STEPS:
        if o := ov.recorded(results.get(info.key)):
            groups.setdefault(ov.flags(o), []).append(info.number)
    if not groups:
        return []
    said = [f"{_steps_named(numbers)} ({flags})" for flags, numbers in groups.items()]
    return [f"Measured with overrides from the command line, not the job file's values: {'; '.join(said)}."]


def _steps_named(numbers: list[int]) -> str:
    """"step 3", "steps 1 and 3", "steps 1, 2 and 3"."""
    if len(numbers) == 1:
        return f"step {numbers[0]}"
    return f"steps {', '.join(map(str, numbers[:-1]))} and {numbers[-1]}"


def bar_meaning(key: str, result: dict[str, Any]) -> str:
    """What a step's MFU bar measures: :data:`BAR_MEANING`, or for a job run in its own layout (steps 1, 3 and
    7 under torchrun) the layout and its ranks; step 1's names its command-line overrides (:func:`the_job`)."""
    lay = (result or {}).get("layout") or {}
    name = (lay.get("layout") or {}).get("name")
    if name and key in ("baseline", "kernels"):
        return f"the job in its layout {name}, {lay.get('world')} ranks, slowest rank per step"
    if key == "verify" and any("in the job's layout" in (r.get("reason") or "") for r in result.get("rungs") or []):
        return "the tuned job in its layout, side by side with the original"
    if key == "baseline":
        return BAR_MEANING[key].replace("the job as it came", the_job(result))
    return BAR_MEANING.get(key, "as the step measured it")


def mfu_points(results: dict[str, dict[str, Any]]) -> list[tuple[str, float, str]]:
    """(step folder, MFU, its label) for every step that reports one, in workbook order; step 2's data-parallel
    MFU is a point of its own (folder ``02_…/DDP``), since it is a different measurement (N ranks)."""
    out = []
    for info in STEPS:
        metrics = results.get(info.key, {}).get("metrics", {})
        m = metrics.get("mfu")
        if m and m.get("value") is not None:
            out.append((info.folder, m["value"], m.get("source", "")))
        ddp = metrics.get("ddp_mfu")
        if ddp and ddp.get("value") is not None:
            out.append((info.folder + "/DDP", ddp["value"], ddp.get("source", "")))
    return out


def peak_dtype(result: dict[str, Any], mfu: float) -> str:
    """The precision whose peak an MFU is against: the job's, or for step 7 the rung that gave it."""
    rung = next((r for r in result.get("rungs") or [] if r.get("mfu") == mfu and r.get("dtype")), None)
    return rung["dtype"] if rung else (result.get("job") or {}).get("dtype", "")


def bar_meanings(results: dict[str, dict[str, Any]]) -> list[str]:
    """Each bar's meaning, in the order of :func:`mfu_points`: one process or data-parallel, eager or compiled,
    measured or modelled; and, when the bars stand on different precisions' peaks, which peak each is against."""
    out, peaks = [], []
    for folder, value, source in mfu_points(results):
        key = next(i.key for i in STEPS if folder.startswith(i.folder))
        peaks.append(peak_dtype(results[key], value))
        if folder.endswith("/DDP"):
            world = (results[key].get("comm_layout") or {}).get("world_size")
            out.append(f"data-parallel, {world} ranks, recommended DDP configuration ({source})")
        else:
            out.append(f"{bar_meaning(key, results[key])} ({source})")
    if len(set(peaks)) > 1:  # an MFU against another peak is not comparable by height: say which
        out = [f"{m}, against the {p} peak" for m, p in zip(out, peaks)]
    return out


def verified_text(v: dict[str, Any]) -> str:
    """Step 7's headline as the index shows it. When the tuned job's MFU stands on another precision's peak than
    the original's, the speed comes first and each MFU names its peak, so a faster job does not read as a
    regression ("tokens/s 2.12x ...; MFU against bfloat16's peak 18.8%, the original's against float32's 59.1%")."""
    h = v.get("headline") or {}
    rungs = [r for r in v.get("rungs") or [] if isinstance(r, dict)]
    # the headline's original: step 7's second turn ("original again", beside the tuned file as written) if it ran
    before = next((r for r in rungs if r.get("name") == "original again" and h.get("as_written")),
                  rungs[0] if rungs else {})
    after = next((r for r in rungs[1:] if r.get("mfu") is not None and r.get("mfu") == h.get("mfu_after")), None)
    sp = h.get("speedup")
    if not (after and sp and before.get("peak_flops_per_s") and after.get("peak_flops_per_s")
            and before["peak_flops_per_s"] != after["peak_flops_per_s"] and before.get("mfu") is not None):
        return str(h.get("text") or "")
    a, b = (r.get("peak_precision") or r.get("dtype") or "its own" for r in (before, after))
    ci = (f" [{h['speedup_low']:.2f}, {h['speedup_high']:.2f}]" if h.get("speedup_low") is not None
          and h.get("speedup_high") is not None else "")
    speed = (f"tokens/s {after['tokens_per_s'] / before['tokens_per_s']:.2f}x (speedup {sp:.2f}x{ci}, measured side "
             "by side)" if before.get("tokens_per_s") and after.get("tokens_per_s")
             else f"speedup {sp:.2f}x{ci} (measured side by side)")
    return (f"{speed}; MFU {after['mfu']:.1%} against {b}'s peak, the original's {before['mfu']:.1%} against {a}'s: "
            f"{b}'s peak is {after['peak_flops_per_s'] / before['peak_flops_per_s']:.2g}x {a}'s here, so compare the "
            "speed, not the MFU" + (f"; {h['note']}" if h.get("note") else ""))


def _states_line(states: dict[str, str]) -> list[str]:
    """The steps the steps table shows as running or unfinished, said the same way here."""
    out = []
    for status, say in (("running", "Running now"), ("interrupted", "Interrupted"), ("failed", "Failed"),
                        ("timeout", "Timed out"), ("damaged", "Result unreadable")):
        folders = [i.folder for i in STEPS if states.get(i.key) == status]
        if folders:
            out.append(f"{say}: {', '.join(folders)} (see the steps table; a result from an earlier run, where "
                       "there is one, is still shown).")
    return out


def peaks_note(results: dict[str, dict[str, Any]]) -> str:
    """One sentence under the MFU chart when its bars stand on different precisions' peaks: for each bar on
    another peak than step 1's, its MFU against that peak and its tokens/s against step 1's, so a lower bar on a
    higher peak does not read as a slower job. '' when every bar is against the same peak."""
    pts = [(f, v, next(i.key for i in STEPS if f.startswith(i.folder))) for f, v, _ in mfu_points(results)]
    peaks = [peak_dtype(results[key], v) for _, v, key in pts]
    if len(set(peaks)) < 2:
        return ""
    ref = peaks[0]
    base_tps = ((results.get("baseline") or {}).get("metrics", {}).get("tokens_per_s") or {}).get("value")
    parts = []
    for (folder, v, key), peak in zip(pts, peaks, strict=True):
        if peak == ref or folder.endswith("/DDP"):
            continue
        tps = ((results[key].get("metrics") or {}).get("tokens_per_s") or {}).get("value")
        speed = f", tokens/s {tps / base_tps:.2f}x step 1's" if tps and base_tps else ""
        parts.append(f"step {folder[:2].lstrip('0')}: MFU {v:.1%} against {peak}'s peak{speed}")
    if not parts:
        return ""
    return (f"The bars stand on different peaks (the first on {ref}'s), so a lower bar is not a slower job: "
            + "; ".join(parts) + ".")


def headline(results: dict[str, dict[str, Any]], states: dict[str, str] | None = None) -> list[str]:
    """A few plain sentences: what was done and where MFU stands (each figure as stored, with its label).
    ``states``: each step's status as the steps table shows it (:func:`mfu_lab.core.store.runstate.step_state`), so a
    step that is running or did not finish is not called "not run yet"."""
    states = states or {}
    if not results and not any(v != "not run" for v in states.values()):
        return ["No step has run yet: run `mfu-lab run` or open notebooks/01_baseline.ipynb."]
    ran = [info for info in STEPS if info.key in results]
    lines = [f"{len(ran)} of {len(STEPS)} steps have results: " + ", ".join(i.folder for i in ran) + "."]
    verified = (results.get("verify") or {}).get("headline") or {}
    if verified.get("text"):
        carried = ", ".join(verified.get("carried") or []) or "none beyond the noise"
        lines.insert(0, f"Verified: {verified_text(results['verify'])}. Changes that carried the gain: {carried} "
                        "(step 7).")
    pts = mfu_points(results)
    base = results.get("baseline", {}).get("metrics", {}).get("mfu")
    if base and base.get("value") is not None:
        lay = ((results.get("baseline") or {}).get("layout") or {})
        where = (f" in its layout {lay['layout']['name']} on {lay.get('world')} ranks"
                 if (lay.get("layout") or {}).get("name") else "")
        shared = ", on a shared machine: see the steps table" if shared_how(results.get("baseline") or {}) is not None \
            else ""
        job = the_job(results.get("baseline"))
        lines.append(f"{job[0].upper()}{job[1:]} measured {base['value']:.1%} MFU{where} (step 1, {base['source']}"
                     f"{shared}).")
    later = [p for p in pts if p[0] != BY_KEY["baseline"].folder]
    if later:
        peak = {f: peak_dtype(results[next(i.key for i in STEPS if f.startswith(i.folder))], v) for f, v, _ in pts}
        ref = peak[pts[0][0]]
        other = {f: f", against {p}'s peak, not {ref}'s" if p != ref else "" for f, p in peak.items()}
        text = "Later steps measured MFU " + ", ".join(
            f"{v:.1%} ({folder[:2]}{', data-parallel' if folder.endswith('/DDP') else ''}{other[folder]})"
            for folder, v, _ in later)
        m = results.get("baseline", {}).get("metrics", {})
        med, p10, p90 = (m.get(k, {}).get("value") for k in ("step_time_median_s", "step_time_p10_s",
                                                              "step_time_p90_s"))
        if med and p10 is not None and p90 is not None:
            text += (f"; step 1's step times spread ±{(p90 - p10) / 2 / med:.0%} (p10-p90), so differences within that "
                     "are run-to-run noise, not gains: the gains are in Changes measured, each timed side by side")
        lines.append(text + ".")
    tuned = standing(results.get("verify") or {})
    to_adopt = [] if tuned is not None else [c for c in changes(results) if c.status == "adopt"]
    if tuned is not None:
        adopted = [c for c in tuned if c.adopted]
        lines.append(f"tuned.yaml adopts {len(adopted)} of {len(tuned)} recommended change(s)"
                     + (": " + "; ".join(f"{c.key}: {c.new} ({c.rung}, {c.label})" for c in adopted)
                        if adopted else "") + " (step 7).")
    if to_adopt:
        lines.append(f"{len(to_adopt)} change(s) to adopt: "
                     + "; ".join(f"{c.change} [{c.source}]" for c in to_adopt) + ".")
    lines += overrides_line(results) + _states_line(states)
    missing = [i.folder for i in STEPS if i.key not in results and states.get(i.key, "not run") == "not run"]
    if missing:
        lines.append("Not run yet: " + ", ".join(missing) + ".")
    return lines


def standing(verify: dict[str, Any]) -> list[tuning.Change] | None:
    """The recommended changes that stand after step 7, as ``tuned.yaml`` holds them (:func:`tuning.in_effect`:
    a layout step 7 withdrew is neither counted nor listed); None when step 7 has not run."""
    stored = verify.get("changes")
    if stored is None:
        return None
    fields = tuning.Change.__dataclass_fields__
    return tuning.in_effect([tuning.Change(**{k: v for k, v in c.items() if k in fields}) for c in stored],
                            verify.get("job") or {})


def ledger_before_after(results: dict[str, dict[str, Any]]) -> tuple[tuple[str, dict] | None, tuple[str, dict] | None]:
    """(title, ledger dict) before and after. Both come from step 7 (verify) when it measured the tuned job: the
    original and the tuned job in the same interleaved rounds, by the same method, so the bars compare like
    with like. Without step 7: step 1's ledger before, and no "after" (no step measured the tuned job). An earlier
    run's item names are mapped to today's (:func:`mfu_lab.core.measure.ledger.upgrade`)."""
    ledgers = (results.get("verify") or {}).get("ledgers") or {}
    if ledgers.get("before") and ledgers.get("after"):
        return (("Before: the original job (step 7, interleaved rounds)", upgrade(ledgers["before"])),
                ("After: the tuned job (step 7, the same rounds)", upgrade(ledgers["after"])))
    b = results.get("baseline", {}).get("ledger")
    return ((f"Before: {the_job(results.get('baseline'))} (step 1, one process)", upgrade(b)) if b else None), None


def with_operations(ledger: dict[str, Any], ops: float, note: str) -> dict[str, Any]:
    """A step's ledger with the operations loss the production monitor measured: every other bar x (1 - ops),
    and the operations bar = its own (scaled) + ops, so the parts still add up to 100% of peak x wall-clock.
    MFU becomes the step's MFU over the production wall-clock (queue, restarts, stragglers, throttling)."""
    items = []
    for it in ledger["items"]:
        it = dict(it)
        if it["name"] == "operations":
            it["fraction"] = it["fraction"] * (1 - ops) + ops
            it["source"] = "measured"
            it["explanation"] = f"measured in production by the monitor: {note}"
        else:
            it["fraction"] *= 1 - ops
            it["explanation"] += f" (x (1 - {ops:.1%}): the production operations loss)"
        items.append(it)
    return {**ledger, "items": items}


def _contention_records(x: Any, depth: int = 3) -> list[dict[str, Any]]:
    """Every ``contention`` record in a result (step 1's ``timings``, step 3's ``unprofiled`` and ``profiled``, ...),
    a few levels down."""
    if depth < 0 or not isinstance(x, dict | list):
        return []
    items = x.items() if isinstance(x, dict) else enumerate(x[:20])
    out = []
    for k, v in items:
        if k == "contention" and isinstance(v, dict):
            out.append(v)
        else:
            out += _contention_records(v, depth - 1)
    return out


def shared_how(d: dict[str, Any]) -> list[str] | None:
    """How the machine was shared while a step measured (from the busiest of its contention records), [] when a
    record says shared without saying how, None when none says shared."""
    shared = [c for c in _contention_records(d) if c.get("shared")]
    if not shared:
        return None
    c = max(shared, key=lambda c: c.get("other_cores") or 0)
    how = [f"other processes kept {c['other_cores']:.2f} of {c.get('usable_cores')} cores busy"] \
        if isinstance(c.get("other_cores"), int | float) else []
    if c.get("gpu_processes"):
        how.append(f"other processes computed on the GPU ({', '.join(map(str, c['gpu_processes'][:4]))})")
    if isinstance(c.get("load_1min"), int | float):
        how.append(f"load average {c['load_1min']:.2f}")
    return how + [str(r) for r in c.get("rechecks") or []]  # the matmul rate fell: the host's neighbours


def shared_line(d: dict[str, Any]) -> str:
    """One sentence when the machine was shared while the step measured (any of its contention records says so),
    '' otherwise: a shared machine's step times are not the job's, whichever step measured them."""
    how = shared_how(d)
    if how is None:
        return ""
    return ("The machine was shared while this step measured" + (f" ({'; '.join(how)})" if how else "")
            + ": its times and MFU are a shared machine's; rerun on an idle machine before acting on them.")
