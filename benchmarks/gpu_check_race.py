"""gpu_check's forced world of one rank: step 2's DDP worker launched through torchrun on one GPU (NCCL), with
three configurations, so that its race (screening round, finalists measured in full), its confirmation and the
alternation launch all run. Two NCCL ranks cannot share one GPU ("Duplicate GPU detected"), so on a one-GPU
machine a world of one is the only way these paths run at all: ``set_device``, ``broadcast_object_list``,
``DDP(device_ids)``, barrier and teardown. Its timings are not DDP's (nothing to all-reduce with one rank); the
rows check that each path ran and finished, not a figure.

The same function runs on a CPU over gloo (``device_type="cpu"``), which is how the test suite exercises it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpu_check_table import Ctx, Row, fail_row, skip_row

PATH = "step 2 (world 1)"
HOOKS, BUCKETS_MB = ["none", "allreduce"], [25, 1]  # the first three of these: a race, never "nothing to race"


def race_job(job):
    """The check's job for the forced launch: one rank, three configurations, the race's short protocol."""
    return dataclasses.replace(job, nproc_per_node=1, nnodes=1, comm_hooks=list(HOOKS), comm_bucket_mb=list(BUCKETS_MB),
                               comm_grad_as_bucket_view=[False], thorough=False)


def step_race_one_rank(ctx: Ctx, rows: list[Row], device_type: str = "cuda") -> dict:
    """Run the forced launch and its alternation; add one row per path. Returns what was seen (for the test)."""
    from mfu_lab.workers.alternate import alternate
    from mfu_lab.workers.comm_configs import config_key, config_name, sweep_configs
    from mfu_lab.workers.launch import run_sweep

    job = race_job(ctx.job)
    configs = sweep_configs(job)[:3]  # hooks every backend runs (gloo refuses bf16_compress)
    ref = config_name(configs[0])
    work = Path(ctx.out) / "gpu-check" / "race1"
    sweep = run_sweep(job, device_type, None, work, None, configs=configs, screen=job.race_steps,
                      race={"references": [ref], "deadline": None},
                      confirm={"reference": ref, "turns": 2, "deadline": None}, force_one_rank=True)
    done = [c for c in configs if (sweep.outcomes.get(config_key(c)) or {}).get("event") == "done"]
    launch = sweep.launches[0] if sweep.launches else {}
    rows.append(Row(PATH, "forced world-1 launch", f"{len(done)}/{len(configs)} configurations done over "
                    f"{sweep.layout.get('backend')}, {len(sweep.launches)} launch(es)", "measured",
                    "pass" if len(done) == len(configs) and len(sweep.launches) == 1 else "fail"))
    by_number = {r.get("number"): r for r in sweep.rounds}
    for n, what in ((1, "race round 1 (screening)"), (2, "race round 2 (finalists in full)")):
        r = by_number.get(n)
        rows.append(Row(PATH, what, f"kept {', '.join(r['kept'])} in {r['seconds']:.1f} s", "measured", "pass")
                    if r else fail_row(PATH, what, f"no round {n} event from the worker (launch: {launch})"))
    c = sweep.confirm
    if c is None:
        rows.append(fail_row(PATH, "confirmation in the race's launch", "no confirm event from the worker"))
    elif c.get("candidate") is None:  # the reference stood: nothing to confirm, which is the step's rule
        rows.append(skip_row(PATH, "confirmation in the race's launch", f"the reference ({ref}) stood"))
    elif c.get("skipped"):
        rows.append(skip_row(PATH, "confirmation in the race's launch", c["skipped"]))
    else:
        rows.append(Row(PATH, "confirmation in the race's launch", f"{c['candidate']} against {c['reference']}, "
                        f"{len(sweep.turns)} turns", "measured", "pass" if len(sweep.turns) == 2 * c["turns"]
                        and c.get("done") else "fail"))
    alt = alternate(job, device_type, None, configs[:2], 2, work / "confirm")  # confirm_pick's own launch
    rows.append(fail_row(PATH, "confirmation launch (alternation)", alt.error) if alt.error else
                Row(PATH, "confirmation launch (alternation)", f"{len(alt.order)} turns in {alt.seconds:.1f} s",
                    "measured", "pass" if len(alt.order) == 4 else "fail"))
    return {"sweep": sweep, "alternation": alt}


def confirmation_row(path: str, figure: str, c) -> Row:
    """A step's confirmation (``analysis.racing.Confirmation``) as a row: it ran and finished (pass, with its
    speedup; whether the pick stood is the step's verdict, not the check's), was skipped (skip, with why), or failed
    (fail): a failed confirmation is never a pass."""
    if c is None:
        return skip_row(path, figure, "nothing to confirm (the reference led, or no race ran)")
    if c.status == "skipped":
        return skip_row(path, figure, c.reason)
    if c.status != "ok":
        return fail_row(path, figure, f"{c.status}: {c.reason}")
    ok = c.turns > 0 and len(c.order) == 2 * c.turns and c.speedup is not None
    return Row(path, figure, f"{c.candidate} against {c.reference}: speedup {c.speedup or 0:.3f} "
               f"[{c.low or 0:.3f}, {c.high or 0:.3f}] over {c.turns} turns", "measured", "pass" if ok else "fail")


def round_rows(path: str, race) -> list[Row]:
    """A race's rounds (``analysis.racing.RaceLog``), one row each, and its confirmation."""
    if race is None:
        return [skip_row(path, "DDP race", "no DDP sweep ran")]
    out = [Row(path, f"DDP race round {r.number}", f"{len(r.kept)} kept, {len(r.dropped)} dropped in "
               f"{r.seconds or 0:.1f} s", "measured", "pass") for r in race.rounds]
    if not race.rounds:
        out.append(skip_row(path, "DDP race", race.note or "no round ran"))
    out.append(confirmation_row(path, "DDP confirmation", race.confirmation))
    return out
