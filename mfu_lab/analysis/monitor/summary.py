"""What a monitor folder says about the job in production: the shares of the step, the stragglers, the
operations loss measured where it happens, and which tuning step to start with.

Formulas (over every rank's interval records; sums of seconds, so long intervals weigh more):

- data share = data wait / wall of the intervals whose data wait was timed ("not timed" when none was: a loop
  without a wrapped loader, or a framework adapter that could not tell the fetch apart);
- host share = host time outside the step / wall; other share = evaluation, checkpoints and logging outside the
  training steps / wall (kept out of MFU: MFU = FLOPs / (peak x (wall - other)));
- communication share = time with a collective in flight / wall of the intervals whose collectives were timed
  (overlapped with compute or not; on a fast rank it includes waiting for a slower one);
- compute share = 1 - data - host - other - communication: the step's time with no collective in flight and no
  wait for data (a lower bound of the time computing when communication overlaps compute; it holds the data
  wait when that was not timed);
- waiting for the slowest rank: per interval group, sum over ranks of (slowest rank's work per step - own)
  x steps, where work = wall - communication; its share is of all ranks' wall time;
- operations loss, each part as a share of the wall-clock (Slurm's submit time, or the first start, to the last
  record): throttled clocks (wall x busy samples with a power or thermal reason x (1 - their clock / the clock the
  datasheet peak assumes, NVML's max where the chip has none; capped at 1), per rank, / ranks), waiting for the
  slowest rank (/ ranks), restarts and gaps (from a launch's last record to the next launch's first timed step),
  the queue (Slurm submit to start).
"""

from __future__ import annotations

import datetime as _dt
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis.monitor.read import Folder, Straggling, read_folder
from mfu_lab.analysis.monitor.runs import describe
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.thresholds import COMM_LIMIT, DATA_WAIT_LIMIT

LOSS_FLOOR = 0.05  # when no loss reaches 5% of the step, the job is compute-bound: start with the kernels

# which tuning step answers which slice (the step key, and why)
START_WITH = {
    "data": ("baseline", "step 1 times the loader and says which DataLoader settings to change"),
    "host": ("baseline", "step 1 separates host time; move logging, checkpoints and evaluation off the step"),
    "other": ("baseline", "evaluation, checkpoints and logging are the job's schedule, not the training step: run "
                          "them less often or asynchronously; step 1 measures the training step alone"),
    "communication": ("attention_comm", "step 2 tunes DDP's buckets and hooks and measures exposed communication"),
    "stragglers": ("placement", "a slow rank or node holds every other back: check its health (mfu-lab gate) "
                                "and step 6's placement"),
    "operations": ("placement", "step 6 models placement on the cluster; throttling and restarts are the "
                                "cluster's side"),
    "compute": ("kernels", "no loss outside the step dominates: step 3 shows which kernels eat the time"),
}


def labelled(value: float | None, label: str, note: str, seconds: float | None = None) -> dict[str, Any]:
    out = {"value": value, "label": label if value is not None else "unknown", "note": note}
    if seconds is not None:
        out["seconds"] = seconds
    return out


@dataclass
class MonitorSummary:
    folder: str
    read: dict[str, Any]
    span: dict[str, Any]
    devices: list[str]
    mfu: dict[str, Any]
    tokens_per_s: dict[str, Any]
    step_time_s: dict[str, Any]
    shares: dict[str, dict[str, Any]]
    profile: dict[str, Any]
    operations_loss: dict[str, Any]
    stragglers: list[dict[str, Any]]
    node_stragglers: list[dict[str, Any]]
    start_with: str | None
    verdict: str
    figures: dict[str, float] = field(default_factory=dict)
    series: dict[str, Any] = field(default_factory=dict)
    launches: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    samples_per_s: dict[str, Any] = field(default_factory=dict)  # the monitor's samples= (work that is not tokens)
    flops_per_token: dict[str, Any] = field(default_factory=dict)  # counted (or given), beside a framework's own


def summarise(folder: Path, progress=None, run: str | None = None) -> MonitorSummary:
    """The summary of one run of a monitor folder (``run``; default: the latest by start time); ``progress(line)``
    hears how far the read got on a large one. A ``run`` the folder does not hold raises ValueError."""
    st = read_folder(folder, progress, run)
    plan = st.plan
    if run is not None and run not in plan.runs:
        raise ValueError(f"no run {run!r} in {folder}; its runs: {', '.join(repr(k) for k in plan.runs) or 'none'}")
    tot = st.total
    notes = []
    c, sk = st.count, st.skipped
    read = {"files": st.files, "ranks": len(st.per_rank) or len(st.ranks), "nodes": len(st.per_node),
            "lines": c.lines, "records": c.records - sk.records - sum(st.left_out.values()),
            "skipped_lines": c.skipped, "skipped_examples": c.skipped_examples,
            "unreadable_files": c.unreadable_files, "skipped_records": sk.records,
            "skipped_record_fields": sk.by_field, "skipped_record_examples": sk.examples,
            "intervals": tot.intervals, "steps": tot.steps, "run": plan.chosen,
            "other_runs": [{"run": k, "records": v["records"], "ranks": len(v["ranks"]), "launches": v["launches"],
                            "first": _iso(v["first_t"]), "last": _iso(v["last_t"])}
                           for k, v in sorted(plan.runs.items()) if k != plan.chosen],
            "clock": plan.clock}
    if c.skipped:
        notes.append(f"{c.skipped} line(s) were not readable records and were skipped (torn by a crash, edited, or "
                     f"another format): {', '.join(c.skipped_examples)}")
    if sk.records:
        fields = ", ".join(f"{k} ({n})" for k, n in sorted(sk.by_field.items()))
        notes.append(f"{sk.records} record(s) with a wrong type, a value that is not finite or a negative duration "
                     f"were skipped: {fields}; first: {'; '.join(sk.examples)}")
    notes += describe(plan)
    for u in c.unreadable_files:
        notes.append(f"unreadable file skipped: {u}")
    launches = sorted(st.launches.values(), key=lambda lau: lau.first_t)
    queue_s, queue_note = _queue(launches)
    first = min((lau.first_t for lau in launches), default=0.0)
    last = max((lau.last_t for lau in launches), default=0.0)
    submit = min((lau.slurm["SubmitTime"] for lau in launches if "SubmitTime" in lau.slurm), default=None)
    wall_clock = last - (submit if submit is not None and submit < first else first)
    run_span = last - first
    span = {"first_t": first, "last_t": last, "run_s": run_span, "wall_clock_s": wall_clock,
            "launches": len(launches), "world": st.world}

    shares = _shares(st)
    ops = _operations(st, launches, wall_clock, queue_s, queue_note)
    stragglers = _named(st.stragglers, st, node=False)
    node_stragglers = _named(st.node_stragglers, st, node=True)
    profile = _profile(st)
    start, verdict, figures = _verdict(shares, ops, stragglers, st.world, profile)
    mfu = tot.mfu
    peaks = sorted({str((s.get("peak") or {}).get("source")) for s in st.ranks.values() if s.get("peak")})
    out = MonitorSummary(
        str(folder), read, span, sorted({str((s.get("device") or {}).get("name")) for s in st.ranks.values()}),
        labelled(mfu, "measured", "model FLOPs x steps / (peak x (wall - evaluation, checkpoints, logging)), "
                 "weighted by that time over every rank's intervals; "
                 f"peak: {', '.join(peaks) or 'none'}" if mfu is not None else
                 "no interval carried an MFU: give the monitor flops_per_token or the model"),
        labelled(tot.tokens / tot.tokens_wall * st.world if tot.tokens_wall else None, "measured",
                 "tokens per second of all ranks together (each rank's tokens / its wall time, x ranks)"),
        labelled(tot.step_median, "measured", "the intervals' median step times, weighted by their steps"),
        shares, profile, ops, stragglers, node_stragglers, start, verdict, figures, _series(st, stragglers),
        [{"launch": k, "first_t": v.first_t, "last_t": v.last_t, "first": _iso(v.first_t), "last": _iso(v.last_t),
          "ranks": len(v.ranks),
          "clean_end": len(v.ended) == len(v.ranks), "slurm": v.slurm} for k, v in st.launches.items()],
        notes)
    out.samples_per_s = labelled(tot.samples / tot.samples_wall * st.world if tot.samples_wall else None, "measured",
                                 "samples per second of all ranks together (each rank's samples / its wall time, x "
                                 "ranks): the monitor's samples=, for work that is not tokens")
    out.flops_per_token = _flops_per_token(st)
    return out


def _flops_per_token(st: Folder) -> dict[str, Any]:
    """The FLOPs per token behind MFU: the lowest rank's count (every rank counts its own step; they agree when the
    ranks run the same model); beside it, the framework's own figure per optimizer step when the adapter recorded
    one (Hugging Face's total_flos, a Lightning module's flops_per_batch) for the same launch, see _framework."""
    order = sorted(st.flops, key=lambda k: (k[1], k[0]))
    counts = [st.flops[k] for k in order if st.flops[k].get("per_token")]
    if counts:
        c = counts[0]
        out = labelled(c["per_token"], "counted", f"one training step counted by the workbook's counter (step "
                       f"{c.get('step')})")
    else:
        given = [f for f in ((s.get("flops") or {}) for s in st.ranks.values()) if f.get("per_token")]
        out = (labelled(given[0]["per_token"], "analytic", str(given[0].get("note") or "given to the monitor"))
               if given else labelled(None, "counted", "no FLOPs per token were counted (no tokens, or no count: "
                                      "the monitor's notes say why)"))
    key = next((k for k in order if st.flops[k].get("per_step")), None)
    said = _framework(st, key) if key is not None else ""
    if said:
        out["note"] = f"{out['note']}; {said}" if out["value"] is not None else said
        out["framework"] = said
    return out


def _framework(st: Folder, key: tuple[str, int]) -> str:
    """The framework's figure against the count of rank ``key``, per optimizer step, when both come from the same
    launch and every step did the same work (the framework's is the run's average, the count one step's: a short
    last step of an epoch, or varying lengths, would skew the ratio); else why not, or "" when there is none."""
    c, fw = st.flops[key], st.framework.get(key) or {}
    if not fw.get("per_step"):
        return ""
    name = fw.get("name")
    if fw.get("launch") != c.get("launch"):
        return f"{name} is from another launch than the count: not compared"
    sums = st.per_rank.get(key)
    if c.get("tokens") and sums is not None and sums.steps and abs(sums.tokens / sums.steps / c["tokens"] - 1) > 0.005:
        return (f"{name} ({fw['per_step']:,.0f} FLOPs per optimizer step, the run's average) not compared: the steps' "
                f"tokens varied ({sums.tokens / sums.steps:,.0f} a step on average against the counted step's "
                f"{c['tokens']:,})")
    r = fw["per_step"] / c["per_step"]
    far = ("the same" if abs(r - 1) < 0.005 else f"{1 - r:.0%} lower" if r < 1 else
           f"{r - 1:.0%} higher" if r <= 2 else f"{r:.1f}x as high")
    return (f"{name} adds up {fw['per_step']:,.0f} FLOPs per optimizer step over {fw.get('steps')} step(s) of this "
            f"rank, {r:.2f}x the {c['per_step']:,.0f} counted ({fw.get('how')}): an MFU from it would read {far}")


def _iso(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="seconds")


def _shares(st: Folder) -> dict[str, dict[str, Any]]:
    tot = st.total
    data, host, comm, other = tot.share("data"), tot.share("host"), tot.share("comm"), tot.share("other")
    wait = st.wait_s / tot.wall if tot.wall and st.groups else None
    not_timed = tot.wall > 0 and tot.data_wall == 0
    compute = None if tot.wall <= 0 else max(0.0, 1.0 - (data or 0.0) - (host or 0.0) - (comm or 0.0) - (other or 0.0))
    comm_why = next((str((s.get("comm") or {}).get("how")) for s in st.ranks.values()
                     if not (s.get("comm") or {}).get("timed")), "no interval timed its collectives")
    part = f" (over the {tot.data_wall / tot.wall:.0%} of the wall time where it was timed)" \
        if data is not None and tot.data_wall < tot.wall else ""
    data_row = ({"value": None, "label": "not timed", "note": "the monitor timed no data fetch (no wrapped loader, "
                 "fetch() or step(data_wait_s=)): the data wait is unknown and sits inside compute"}
                if not_timed else labelled(data, "measured", "time the loop waited for its next batch, over wall "
                                           "time" + part))
    return {
        "compute": labelled(compute, "measured", "1 - data - host - other - communication: no collective in flight, "
                            "no wait for data (a lower bound of computing when communication overlaps it)"
                            + ("; it includes the data wait, which was not timed" if not_timed else "")),
        "communication": labelled(comm, "measured", "time with a collective in flight, overlapped or not; on fast "
                                  "ranks it includes waiting for the slowest" if comm is not None else comm_why),
        "data": data_row,
        "host": labelled(host, "measured", "host time between steps (the loop, logging the monitor could not tell "
                         "apart)") if host is not None or tot.wall <= 0 else
        {"value": None, "label": "not timed", "note": "host time is timed from step() to the wrapped loader's next "
         "request: no loader was wrapped"},
        "other": labelled(other, "measured", "evaluation, checkpoints, logging outside the training steps, as the "
                          "framework's hooks (or Monitor.other()) timed them; kept out of MFU and tokens/s")
        if other is not None else labelled(None, "measured", "not recorded apart: these records (written before "
                                           "the monitor separated them) hold such time inside data or host time"),
        "waiting_for_slowest": labelled(wait, "measured", "part of communication: the time each rank waited in its "
                                        "collectives for the slowest rank, over all ranks' wall time"
                                        if wait is not None else _no_groups(st, comm_why)),
    }


def _no_groups(st: Folder, comm_why: str) -> str:
    """Why no interval group of two or more ranks was formed: the reason that holds, not a guess."""
    if len(st.per_rank) < 2:
        return "one rank: no rank waits for another"
    if st.total.comm_wall == 0:
        return f"collectives not timed: {comm_why}"
    clock = st.plan.clock if st.plan else {}
    if clock.get("not_corrected") or clock.get("not_compared"):
        return ("rank clocks disagree and could not be corrected, so their intervals could not be matched: "
                + "; ".join(clock.get("not_corrected", []) + clock.get("not_compared", [])))
    return "no interval step was recorded by two ranks of one launch"


def _queue(launches) -> tuple[float | None, str]:
    waits = [lau.slurm["queue_wait_s"] for lau in launches if "queue_wait_s" in lau.slurm]
    if waits:
        return float(sum(waits)), "Slurm's submit to start time (scontrol or sacct), summed over launches"
    if any(lau.slurm.get("why") for lau in launches):
        return None, next(lau.slurm["why"] for lau in launches if lau.slurm.get("why"))
    return None, "no Slurm job id in the record: queue wait not known"


def _operations(st: Folder, launches, wall_clock: float, queue_s, queue_note) -> dict[str, Any]:
    world = max(1, st.world)
    gaps_s, gap_count = 0.0, 0
    for prev, nxt in zip(launches, launches[1:]):
        resumed = nxt.first_interval_t0 if nxt.first_interval_t0 is not None else nxt.first_t
        gaps_s += max(0.0, resumed - prev.last_t)
        gap_count += 1
    sampled = any((s.get("nvml") or {}).get("sampled") for s in st.ranks.values())
    nvml_why = next((str((s.get("nvml") or {}).get("why")) for s in st.ranks.values()), "no start record")

    def share(seconds):
        return seconds / wall_clock if seconds is not None and wall_clock > 0 else None

    throttle = st.total.throttle_s / world if sampled else None
    wait = st.wait_s / world if st.groups else None
    parts = {
        "throttling": labelled(share(throttle), "measured", "wall x busy NVML samples with a power or thermal clock "
                               "reason x (1 - their SM clock / the datasheet peak's clock, else max), per rank, / ranks"
                               if sampled else
                               f"clocks not sampled: {nvml_why}", throttle),
        "stragglers": labelled(share(wait), "measured", "rank-seconds waiting in collectives for the slowest rank "
                               "/ ranks" if st.groups else _no_groups(st, "no interval timed its collectives"), wait),
        "restarts_and_gaps": labelled(share(gaps_s), "measured", f"{gap_count} restart(s): from a launch's last "
                                      "record to the next one's first timed step" if gap_count else
                                      "one launch: no restart recorded", gaps_s),
        "queue": labelled(share(queue_s), "measured", queue_note, queue_s),
    }
    known = [p["value"] for p in parts.values() if p["value"] is not None]
    unknown = [k for k, p in parts.items() if p["value"] is None]
    return {"parts": parts, "total": labelled(sum(known) if known else None, "measured",
                                              "the known parts added" + (f"; unknown: {', '.join(unknown)}"
                                                                         if unknown else "")),
            "wall_clock_s": wall_clock}


def _named(table: dict, st: Folder, node: bool) -> list[dict[str, Any]]:
    """Ranks (or nodes) slowest in at least half of their interval groups: consistent stragglers."""
    out = []
    total_wall = st.total.wall or 1.0
    for key, s in table.items():
        s: Straggling
        if s.groups and s.slowest / s.groups >= 0.5:
            out.append({"node": key if node else key[0], "rank": None if node else key[1],
                        "slowest_share": s.slowest / s.groups, "groups": s.groups,
                        "excess": statistics.median(s.excess) if s.excess else None,
                        "others_lost_s": s.lost_s, "others_lost_share": s.lost_s / total_wall})
    return sorted(out, key=lambda d: -d["others_lost_s"])


def _verdict(shares, ops, stragglers, world: int = 2, profile: dict | None = None) -> tuple[str | None, str,
                                                                                         dict[str, float]]:
    """Which loss to start with. Communication is judged by what is exposed: the profiler windows' communication
    outside compute when there are any, else the time with a collective in flight (net of waiting for the
    slowest), said so; at a world of one rank there is no gradient to all-reduce and no communication verdict."""
    def v(d):
        return d["value"] if d and d.get("value") is not None else None

    wait = v(shares["waiting_for_slowest"]) or 0.0
    comm = v(shares["communication"]) if world > 1 else None
    exposed = ((profile or {}).get("breakdown") or {}).get("communicating")
    if comm is not None and isinstance(exposed, int | float):
        comm, wait = exposed, 0.0  # the windows' exposed share: overlap measured, not assumed
    ops_rest = sum(v(p) or 0.0 for k, p in ops["parts"].items() if k != "stragglers")
    figures = {k: x for k, x in {
        "data": v(shares["data"]), "host": v(shares["host"]), "other": v(shares.get("other")),
        "communication": None if comm is None else max(0.0, comm - wait),
        "stragglers": wait if stragglers else None, "operations": ops_rest or None}.items() if x is not None}
    if not figures and v(shares["compute"]) is None:
        return None, "no interval record was readable: nothing to judge", {}
    name, value = max(figures.items(), key=lambda kv: kv[1]) if figures else ("compute", 0.0)
    if value < LOSS_FLOOR:
        name, value = "compute", v(shares["compute"]) or 0.0
    key, why = START_WITH[name]
    info = BY_KEY[key]
    what = {"data": "waiting for data", "host": "host time between steps", "other": "evaluation, checkpoints and "
            "logging outside the training steps", "communication": "exposed communication (outside compute, "
            "from the profiler windows)" if isinstance(exposed, int | float) else "communication in flight (net of "
            "waiting for the slowest rank; no profiler window measured how much of it compute hides)",
            "stragglers": "waiting for the slowest rank", "operations":
            "operations loss (throttling, restarts, queue)", "compute": "computing (no loss outside the step "
            f"above {LOSS_FLOOR:.0%})"}[name]
    base = "of the wall-clock" if name == "operations" else "of the step"
    limit = {"data": DATA_WAIT_LIMIT, "communication": COMM_LIMIT}.get(name)
    rule = f" (practitioners aim under {limit:.0%})" if limit else ""
    caveat = ("; the data wait was not timed, so it sits inside compute: time the fetch (Monitor.fetch() or "
              "step(data_wait_s=...)) before trusting this" if name == "compute" and
              shares["data"].get("label") == "not timed" else "")
    return key, f"{what} is {value:.0%} {base}{rule}: start with step {info.number} ({why}){caveat}", figures


def _profile(st: Folder) -> dict[str, Any]:
    if not st.profiles:
        return {"windows": 0, "breakdown": None, "note": "no profiler window in the record (profile_every_s=None, "
                "or the job ended before the first one)"}
    keys = ("computing", "communicating", "copying", "waiting_for_data", "idle", "comm_total")
    w = sum(float(p.get("window_s") or 0.0) for p in st.profiles) or 1.0
    mean = {k: sum(float(p["breakdown"].get(k) or 0.0) * float(p.get("window_s") or 0.0) for p in st.profiles) / w
            for k in keys}
    over = [float(p.get("overhead_s") or 0.0) for p in st.profiles]
    return {"windows": len(st.profiles), "breakdown": mean, "overhead_s_mean": statistics.fmean(over),
            "note": "torch.profiler windows analysed by the workbook's trace analysis, weighted by their length"}


def _series(st: Folder, stragglers: list[dict[str, Any]]) -> dict[str, Any]:
    """Time bins for the plots: shares and MFU overall and per node, step time per rank, GPU health."""
    mids = [(a + b) / 2 for a, b in zip(st.edges, st.edges[1:])]
    keep = [i for i, b in enumerate(st.bins) if b.intervals]
    pick = [mids[i] for i in keep]

    def col(bins, fn):
        return [fn(bins[i]) for i in keep]

    ranks = sorted(st.rank_bins)
    slow = {(s["node"], s["rank"]) for s in stragglers}
    shown = [k for k in ranks if k in slow] + [k for k in ranks if k not in slow][: max(0, 16 - len(slow))]
    band = []
    for i in keep:
        vals = sorted(b[i].work_per_step for b in st.rank_bins.values() if b[i].steps)
        band.append((vals[0], statistics.median(vals), vals[-1]) if vals else (None, None, None))
    return {
        "t": pick,
        "mfu": col(st.bins, lambda b: b.mfu),
        "shares": {p: col(st.bins, lambda b, p=p: b.share(p)) for p in ("data", "host", "comm", "other")},
        "mfu_by_node": {n: col(bins, lambda b: b.mfu) for n, bins in st.node_bins.items()},
        "work_by_rank": {f"{k[0]}/rank{k[1]}": col(st.rank_bins[k], lambda b: b.work_per_step) for k in shown},
        "work_is_step": st.total.comm_wall == 0,  # no collective timed: each rank's work is its step time
        "work_band": band, "stragglers": [f"{n}/rank{r}" for n, r in slow],
        "gpu": {"temperature_c_max": col(st.gpu_bins, lambda g: g.temperature_c_max),
                "clock_ratio": col(st.gpu_bins, lambda g: g.clock_sum / g.clock_n if g.clock_n else None),
                "throttled_share": col(st.gpu_bins, lambda g: g.throttled_sum / g.n if g.n else None),
                "power_w": col(st.gpu_bins, lambda g: g.power_sum / g.n if g.n else None),
                "xid": col(st.gpu_bins, lambda g: g.xid)},
        "launch_starts": sorted(lau.first_t for lau in st.launches.values()),
    }
