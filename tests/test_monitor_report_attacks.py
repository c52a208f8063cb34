"""`mfu-lab monitor report` over folders nobody should have to read (issue 31, "a report that reads anything"):
records of a wrong type or not finite, two jobs in one folder, rank clocks far apart, a data wait nobody timed.
Each folder is written by hand in the monitor's record shapes; the report exits 0, never prints a traceback, and
names what it skipped, left out or corrected."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mfu_lab.analysis.monitor.summary import summarise
from mfu_lab.cli import main
from mfu_lab.core.errors import JobError
from mfu_lab.steps import monitor

from .conftest import in_process

T0 = 1_790_000_000.0  # a unix time in 2026
LAUNCH = "torchrun:job:m:1#0"


def _start(rank, node="h", launch=LAUNCH, t=T0, world=2, **extra):
    return {"kind": "start", "v": 1, "t": t, "launch": launch, "rank": rank, "node": node, "world": world,
            "comm": {"timed": True, "how": "test"}, "device": {"type": "cpu", "name": "cpu"}, **extra}


def _interval(rank, g, node="h", launch=LAUNCH, work=0.5, t0=T0, steps=10, **extra):
    """Interval g (0, 1, ...) of a rank whose work is ``work`` s per step; every step takes 1 s (the slowest
    rank's work plus the wait in the all-reduce), so every rank ends it at t0 + 10 (g + 1)."""
    wall = 1.0 * steps
    t = t0 + 10.0 + wall * (g + 1)
    return {"kind": "interval", "v": 1, "t": t, "t0": t - wall, "launch": launch, "rank": rank, "node": node,
            "step": steps * (g + 1), "steps": steps, "wall_s": wall, "data_s": 0.05 * wall, "host_s": 0.0,
            "comm_s": wall - steps * work, "step_s": {"median": wall / steps}, "tokens": 1000 * steps,
            "mfu": 0.3, **extra}


def _end(rank, node="h", launch=LAUNCH, t=T0 + 100.0):
    return {"kind": "end", "v": 1, "t": t, "launch": launch, "rank": rank, "node": node, "reason": "closed"}


def _write(path: Path, recs: list, raw: list[str] | None = None) -> None:
    lines = [json.dumps(r) for r in recs] + list(raw or [])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _job(folder: Path, intervals: int = 4, work=(0.5, 0.7), shift=(0.0, 0.0), **kw) -> None:
    """A clean two-rank job: rank 1 works 0.2 s per step more (the straggler); ``shift`` moves each rank's
    clock."""
    for rank in (0, 1):
        recs = [_start(rank, **kw)] + [_interval(rank, g, work=work[rank], **kw) for g in range(intervals)] + \
            [_end(rank, **kw)]
        for r in recs:
            r["t"] += shift[rank]
            if "t0" in r:
                r["t0"] += shift[rank]
        _write(folder / f"h-rank{rank}.jsonl", recs)


def _report(folder: Path, tmp_path: Path, monkeypatch, capsys, *args) -> tuple[str, dict]:
    """`mfu-lab monitor report` through the CLI's main(), papermill hidden (summary.json only: the notebook run
    is tested once, below, over every attack together)."""
    monkeypatch.setitem(sys.modules, "papermill", None)
    out = tmp_path / "rep"
    assert main(["monitor", "report", str(folder), "--out", str(out), "-q", *args]) == 0
    text = capsys.readouterr()
    assert "Traceback" not in text.out + text.err
    return text.out, json.loads((out / "summary.json").read_text())


def _one_bad_field(folder: Path, field: str, value) -> None:
    _job(folder)
    bad = _interval(1, 4, work=0.7) | {field: value}
    with open(folder / "h-rank1.jsonl", "a") as f:
        f.write(json.dumps(bad) + "\n")


@pytest.mark.parametrize("field, value, named", [
    ("wall_s", "abc", "interval: wall_s"),
    ("rank", "abc", "interval: rank"),
    ("steps", 0.5, "interval: steps"),
    ("wall_s", -3.0, "interval: wall_s"),
    ("data_s", -1.0, "interval: data_s"),
    ("comm_s", "1.0", "interval: comm_s"),
    ("gpu", {"throttled_share": "x"}, "interval: gpu.throttled_share"),
    ("t", 1e300, "interval: t"),  # finite, but no date: the report prints dates
    ("node", 7, "interval: node"),
])
def test_a_record_with_a_wrong_type_or_a_negative_duration_is_skipped_and_named(tmp_path, monkeypatch, capsys,
                                                                                    field, value, named):
    folder = tmp_path / "mon"
    _one_bad_field(folder, field, value)
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    assert s["read"]["skipped_records"] == 1 and named in s["read"]["skipped_record_fields"]
    assert named in out and "skipped" in out  # the CLI names it
    assert s["read"]["intervals"] == 8  # the good ones all read
    assert [x["rank"] for x in s["stragglers"]] == [1]


@pytest.mark.parametrize("literal, named", [('"t": NaN', "interval: t"), ('"wall_s": NaN', "interval: wall_s"),
                                            ('"comm_s": Infinity', "interval: comm_s")])
def test_non_finite_values_never_reach_the_verdict(tmp_path, monkeypatch, capsys, literal, named):
    """JSON has no NaN, but Python's json reads it: a hand-edited or foreign file can hold one."""
    folder = tmp_path / "mon"
    _job(folder)
    rec = json.dumps(_interval(0, 4) | {"t": 1.0, "wall_s": 1.0, "comm_s": 0.5})
    key = literal.split(":")[0]
    rec = rec.replace(f'{key}: 1.0', literal) if f"{key}: 1.0" in rec else rec.replace(f'{key}: 0.5', literal)
    assert literal in rec
    with open(folder / "h-rank0.jsonl", "a") as f:
        f.write(rec + "\n")
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    assert s["read"]["skipped_records"] == 1 and named in s["read"]["skipped_record_fields"]
    assert "nan" not in s["verdict"].lower() and "inf" not in s["verdict"].lower()
    for d in s["shares"].values():
        assert d["value"] is None or 0.0 <= d["value"] <= 1.0


def test_a_folder_of_nothing_but_bad_records_still_reports(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "mon"
    _write(folder / "h-rank0.jsonl", [_start(0) | {"world": "two"}, _interval(0, 0) | {"wall_s": "abc"},
                                      _interval(0, 1) | {"t": "soon"}], raw=['{"kind": "interval", "t": 1'])
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    # a t that is not a number is a line the file reader itself skips (core.store.monitor_files): named by its line
    assert s["read"]["skipped_records"] == 2 and s["read"]["skipped_lines"] == 2
    assert "nothing to judge" in s["verdict"]
    assert "start: world" in out and "interval: wall_s" in out and "h-rank0.jsonl:3" in out


def test_two_jobs_in_one_folder_are_kept_apart_old_names(tmp_path, monkeypatch, capsys):
    """Two plain `python train.py` jobs (one launch id per process) wrote rank 0 into one file at the same
    time: rank 0 cannot run twice at once, so they are two runs, not one rank with a restart."""
    folder = tmp_path / "mon"
    a, b = f"local:h:100:{T0:.3f}", f"local:h:200:{T0 + 5:.3f}"
    recs = []
    for g in range(4):
        recs += [_interval(0, g, launch=a, work=1.0) | {"comm_s": None},
                 _interval(0, g, launch=b, work=1.0, t0=T0 + 5) | {"comm_s": None}]
    recs = [_start(0, launch=a, world=1), _start(0, launch=b, world=1, t=T0 + 5)] + recs
    recs.sort(key=lambda r: r["t"])
    _write(folder / "h-rank0.jsonl", recs)
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    assert s["span"]["launches"] == 1 and s["read"]["intervals"] == 4
    assert s["operations_loss"]["parts"]["restarts_and_gaps"]["seconds"] == 0.0
    assert s["read"]["run"] == b  # the latest by start time
    assert [r["run"] for r in s["read"]["other_runs"]] == [a] and s["read"]["other_runs"][0]["records"] == 5
    assert "1 other run(s)" in out and a in out


def test_a_crash_and_its_restart_stay_one_run(tmp_path):
    folder = tmp_path / "mon"
    a, b = f"local:h:100:{T0:.3f}", f"local:h:200:{T0 + 200:.3f}"
    recs = [_start(0, launch=a, world=1)] + [_interval(0, g, launch=a) | {"comm_s": None} for g in range(2)]
    recs += [_start(0, launch=b, world=1, t=T0 + 200)] + \
        [_interval(0, g, launch=b, t0=T0 + 200) | {"comm_s": None} for g in range(2)] + \
        [_end(0, launch=b, t=T0 + 300)]
    _write(folder / "h-rank0.jsonl", recs)
    s = summarise(folder)
    assert s.span["launches"] == 2 and not s.read["other_runs"]
    assert s.operations_loss["parts"]["restarts_and_gaps"]["seconds"] > 0


@pytest.mark.parametrize("first_ends_cleanly", [True, False])
def test_two_torchrun_jobs_under_one_launch_id_old_names(tmp_path, first_ends_cleanly):
    """torchrun without --rdzv-id gives every job the run id 'none': two jobs one after the other append to the
    same files under one launch id. The second start of a rank in another process is a new launch: another job
    after a clean end, a restart of the same run after a crash."""
    folder = tmp_path / "mon"
    for rank in (0, 1):
        first = [_start(rank, pid=100 + rank), *[_interval(rank, g) for g in range(3)]]
        if first_ends_cleanly:
            first.append(_end(rank, t=T0 + 60))
        second = [_start(rank, pid=200 + rank, t=T0 + 600),
                  *[_interval(rank, g, t0=T0 + 600, work=(0.7, 0.5)[rank]) for g in range(3)]]
        _write(folder / f"h-rank{rank}.jsonl", first + second)
    s = summarise(folder)
    if first_ends_cleanly:
        assert s.span["launches"] == 1 and len(s.read["other_runs"]) == 1 and s.read["intervals"] == 6
        assert [x["rank"] for x in s.stragglers] == [0]  # the second job's straggler alone
    else:
        assert s.span["launches"] == 2 and not s.read["other_runs"] and s.read["intervals"] == 12
        assert s.operations_loss["parts"]["restarts_and_gaps"]["seconds"] > 0


def test_two_runs_with_run_ids_and_the_run_option(tmp_path, monkeypatch, capsys):
    """Files named <host>-<run>-rank<k>.jsonl, the run in every record: one report per run."""
    folder = tmp_path / "mon"
    for run, t0, work in (("jobA", T0, (0.5, 0.7)), ("jobB", T0 + 3600, (0.7, 0.5))):
        for rank in (0, 1):
            recs = [_start(rank, t=t0), *[_interval(rank, g, work=work[rank], t0=t0) for g in range(3)],
                    _end(rank, t=t0 + 90)]
            _write(folder / f"h-{run}-rank{rank}.jsonl", [r | {"run": run} for r in recs])
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    assert s["read"]["run"] == "jobB" and s["read"]["ranks"] == 2 and s["span"]["launches"] == 1
    assert [x["rank"] for x in s["stragglers"]] == [0]
    assert [r["run"] for r in s["read"]["other_runs"]] == ["jobA"]
    a = summarise(folder, run="jobA")
    assert a.read["run"] == "jobA" and [x["rank"] for x in a.stragglers] == [1]
    with pytest.raises(ValueError, match="jobC"):
        summarise(folder, run="jobC")
    with pytest.raises(JobError, match="jobA"):  # the step names the runs there are
        monitor.run(folder, write=False, progress=lambda line: None, run="jobC")
    assert monitor.run(folder, write=False, progress=lambda line: None, run="jobA").read["run"] == "jobA"


def test_rank_clocks_half_an_hour_apart_are_corrected(tmp_path, monkeypatch, capsys):
    """Rank 1's clock is 30 minutes ahead (over HORIZON_S): without the correction its intervals would never
    meet rank 0's, and the straggler would vanish."""
    folder = tmp_path / "mon"
    _job(folder, intervals=8, shift=(0.0, 1800.0))
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    assert s["read"]["clock"]["corrected"] == ["h/rank1"]
    assert s["read"]["clock"]["offsets_s"]["h/rank1"] == pytest.approx(1800.0)
    assert [x["rank"] for x in s["stragglers"]] == [1] and s["shares"]["waiting_for_slowest"]["value"] > 0
    assert "corrected" in out and "+1800.0 s" in out
    assert s["span"]["run_s"] < 200  # the two ranks' spans lie on one clock


def test_rank_clocks_that_cannot_be_corrected_are_said_so(tmp_path, monkeypatch, capsys):
    """Rank 1's clock jumps (no fixed offset): the report says its clock could not be corrected, and never
    that there is one rank or that collectives were not timed."""
    folder = tmp_path / "mon"
    for rank in (0, 1):
        recs = [_start(rank)]
        for g in range(6):
            r = _interval(rank, g, work=(0.5, 0.7)[rank])
            if rank == 1:
                jump = 1800.0 * (g % 3)  # 0, 30 min, 60 min, 0, ...
                r["t"] += jump
                r["t0"] += jump
            recs.append(r)
        _write(folder / f"h-rank{rank}.jsonl", recs)
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    assert s["read"]["clock"]["not_corrected"]
    assert "could not be corrected" in out
    note = s["shares"]["waiting_for_slowest"]["note"]
    assert "one rank" not in note and "not timed" not in note


def test_a_data_wait_nobody_timed_is_not_timed_and_evaluation_is_its_own_share(tmp_path, monkeypatch, capsys):
    """A nanoGPT-style loop (no loader to wrap) under an adapter that timed evaluation: data says "not timed",
    never 0% measured; evaluation is its own share, out of MFU; the verdict does not send the user to the
    DataLoader's settings."""
    folder = tmp_path / "mon"
    recs = [_start(0, world=1)]
    for g in range(4):
        r = _interval(0, g, work=1.0) | {"comm_s": None, "data_s": None, "data_timed": False, "other_s": 4.0,
                                          "host_s": None, "mfu": 0.3}
        recs.append(r)
    _write(folder / "h-rank0.jsonl", recs)
    out, s = _report(folder, tmp_path, monkeypatch, capsys)
    data = s["shares"]["data"]
    assert data["value"] is None and data["label"] == "not timed"
    assert s["shares"]["other"]["value"] == pytest.approx(0.4) and s["shares"]["other"]["label"] == "measured"
    assert s["mfu"]["value"] == pytest.approx(0.3)  # the record's MFU is over the training time already
    assert "DataLoader" not in s["verdict"] and "waiting for data" not in s["verdict"]
    assert "evaluation, checkpoints and logging" in s["verdict"]
    assert s["shares"]["compute"]["value"] == pytest.approx(0.6)


def test_the_notebook_report_reads_every_attack_at_once(tmp_path):
    """The real `mfu-lab monitor report` (papermill, the 00_monitor notebook, report.html) over one folder
    holding all of the above: exit 0, no error cell, the skipped records and the other run named."""
    folder = tmp_path / "mon"
    _job(folder, intervals=8, shift=(0.0, 1800.0))
    with open(folder / "h-rank0.jsonl", "a") as f:
        for bad in ({"wall_s": "abc"}, {"rank": "abc"}, {"steps": 0.5}, {"data_s": -1.0}):
            f.write(json.dumps(_interval(0, 9) | bad) + "\n")
        f.write(json.dumps(_interval(0, 9)).replace('"wall_s": 10.0', '"wall_s": NaN') + "\n")
        f.write('{"kind": "interval", "t": 17\n')
    other = f"local:h:100:{T0 - 9000:.3f}"
    _write(folder / "sub" / "h-rank0.jsonl", [_start(0, launch=other, world=1, t=T0 - 9000)] +
           [_interval(0, g, launch=other, t0=T0 - 9000) | {"data_timed": False, "data_s": None} for g in range(3)])
    out = tmp_path / "rep"
    r = in_process("monitor", "report", str(folder), "--out", str(out), "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert "5 record(s) with a wrong type" in r.stdout and "1 other run(s)" in r.stdout
    nb = json.loads((out / "00_monitor.ipynb").read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    html = (out / "report.html").read_text()
    assert "interval: wall_s" in html and other in html and "corrected" in html
