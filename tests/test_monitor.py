"""The production monitor (step 0): records written inside a real training loop, read back as shares,
stragglers, the operations loss and a verdict; the CLI and notebook over a monitor folder."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from mfu_lab.analysis.monitor.read import throttle_seconds
from mfu_lab.analysis.monitor.summary import summarise
from mfu_lab.core.errors import JobError
from mfu_lab.core.store.monitor_files import RecordWriter, rank_files, record_path
from mfu_lab.monitor import Monitor
from mfu_lab.monitor.comm import CommTimer, union_seconds
from mfu_lab.monitor.context import launch_id, parse_scontrol

from .conftest import MONITOR_JOB as JOB
from .conftest import MONITOR_LOADER_MS as LOADER_MS
from .conftest import MONITOR_SLOW_MS as SLOW_MS
from .conftest import MONITOR_STEPS as STEPS
from .conftest import ROOT, in_process


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_rank_job_records_per_rank_names_the_straggler_and_starts_with_the_loader(two_ranks):
    files = sorted(p.name for p in two_ranks.glob("*.jsonl"))
    assert len(files) == 2 and files[0].endswith("-rank0.jsonl") and files[1].endswith("-rank1.jsonl")
    for f in two_ranks.glob("*.jsonl"):
        recs = records(f)
        kinds = [r["kind"] for r in recs]
        assert kinds[0] == "start" and kinds[-1] == "end" and "flops" in kinds and "profile" in kinds
        assert recs[0]["comm"]["timed"], recs[0]["comm"]
        windows = [r for r in recs if r["kind"] == "profile"]
        for p in windows:
            if p.get("hang_stack"):  # a child killed for hanging: the record says so with its stacks; CI shows them
                assert "killed" in p["error"], p
                warnings.warn(f"a profiler window's analysis child hung and was killed: {p['error']}\n"
                              f"{p['hang_stack']}", stacklevel=1)
                continue
            assert p["steps_in_trace"] == p["steps"] == 2 and not p.get("error"), p  # the window's own steps
        assert sum(not p.get("error") for p in windows) >= 2, windows
        iv = [r for r in recs if r["kind"] == "interval"]
        # the first step is the warm-up, the second the counted one; profiled steps are left out of the timing
        # (profiled steps after the last timed one are counted in the end record)
        assert sum(r["steps"] + r["profiled_steps"] for r in iv) + recs[-1]["profiled_steps"] == STEPS - 2
        for r in iv:  # the data wait measured against the sleep injected in the loader: machine-independent
            assert r["data_s"] >= r["steps"] * LOADER_MS / 1e3 * 0.95
    s = summarise(two_ranks)
    assert s.read["ranks"] == 2 and s.read["skipped_lines"] == 0
    assert [(x["rank"], x["node"] != "") for x in s.stragglers] == [(1, True)]
    # rank 0 waited in its all-reduce for rank 1's extra sleep, every step
    per_step_wait = s.stragglers[0]["others_lost_s"] / s.read["steps"] * 2
    assert per_step_wait >= SLOW_MS / 1e3 * 0.5
    shares = {k: v["value"] for k, v in s.shares.items()}
    assert max(("data", "communication", "host", "compute"), key=lambda k: shares[k]) == "data"
    assert s.start_with == "baseline" and "waiting for data" in s.verdict and "step 1" in s.verdict
    assert s.operations_loss["parts"]["stragglers"]["value"] > 0
    assert s.operations_loss["parts"]["throttling"]["value"] is None  # CPU: not sampled, and said why
    assert "NVML" in s.operations_loss["parts"]["throttling"]["note"]
    assert s.profile["windows"] >= 2 and s.profile["breakdown"]["waiting_for_data"] >= 0


def test_monitor_report_cli_writes_report_and_summary(two_ranks, tmp_path):
    out = tmp_path / "rep"
    r = in_process("monitor", "report", str(two_ranks), "--out", str(out), "-q", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "verdict: waiting for data" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) >= {"shares", "operations_loss", "stragglers", "start_with"}
    assert summary["start_with"] == "baseline"
    assert {k: v["label"] for k, v in summary["shares"].items()}["data"] == "measured"
    nb = json.loads((out / "00_monitor.ipynb").read_text())
    errors = [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    html = (out / "report.html").read_text()
    assert "Stragglers" in html and "rank 1" in html and "<script src=" not in html


def test_monitor_report_cli_refuses_a_folder_without_records(tmp_path, capsys):
    from mfu_lab.cli import main

    assert main(["monitor", "report", str(tmp_path / "nope")]) == 2
    assert main(["monitor", "report", str(tmp_path)]) == 2
    assert "no such folder" in capsys.readouterr().err
    job = str(ROOT / "tests" / "data" / "tiny.yaml")
    assert main(["validate", job, "-p", f"monitor_dir={tmp_path / 'nope'}", "-p", f"out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert "monitor_dir" in err and "no such folder" in err


def test_a_crash_keeps_every_earlier_record_and_a_restart_is_a_new_launch(tmp_path):
    out = tmp_path / "mon"
    base = [sys.executable, str(JOB), str(out), "--steps", "24", "--every", "5", "--run", "crashy"]  # one run
    r = subprocess.run(base + ["--crash-at", "13"], cwd=ROOT, capture_output=True, timeout=120)
    assert r.returncode != 0  # killed with SIGKILL: no clean close
    (f,) = out.glob("*.jsonl")
    recs = records(f)
    assert [r["kind"] for r in recs].count("interval") == 2 and recs[-1]["kind"] == "interval"
    with open(f, "a") as fh:  # a record torn by the crash
        fh.write('{"kind": "interval", "t": 17')
    subprocess.run(base, cwd=ROOT, check=True, capture_output=True, timeout=120)  # the restart
    s = summarise(out)
    assert s.read["skipped_lines"] == 1 and s.span["launches"] == 2
    assert sorted(x["clean_end"] for x in s.launches) == [False, True]
    gaps = s.operations_loss["parts"]["restarts_and_gaps"]
    assert gaps["label"] == "measured" and gaps["seconds"] > 0


def _interval(t, step, wall, comm, steps=10, **extra):
    return {"kind": "interval", "v": 1, "t": t, "t0": t - wall, "step": step, "steps": steps, "wall_s": wall,
            "data_s": 0.0, "host_s": 0.0, "comm_s": comm, "step_s": {"median": wall / steps}, **extra}


def test_records_of_several_nodes_and_runs_merge_and_the_slow_node_is_named(tmp_path):
    """Two nodes x two ranks, hand-made: node b's rank 3 works 0.2 s per step more. The time the others lose
    is (slowest work - own work) x steps, added over the groups."""
    work = {("a", 0): 0.5, ("a", 1): 0.5, ("b", 2): 0.5, ("b", 3): 0.7}
    for (node, rank), w in work.items():
        wr = RecordWriter(record_path(tmp_path / node, node, rank))  # one subfolder per node, as rsync'd
        wr.write({"kind": "start", "v": 1, "t": 1000.0, "launch": "L", "rank": rank, "node": node, "world": 4,
                  "comm": {"timed": True}})
        for g in range(4):
            wall = 10 * 1.0  # every rank's step is 1 s: the slowest rank's work plus its own wait
            wr.write(_interval(1010.0 + 10 * g, 10 * (g + 1), wall, wall - 10 * w) | {"launch": "L", "rank": rank,
                                                                                         "node": node})
        wr.close()
    s = summarise(tmp_path)
    assert s.read["ranks"] == 4 and s.read["nodes"] == 2
    (st,) = s.stragglers
    assert (st["node"], st["rank"]) == ("b", 3) and st["slowest_share"] == 1.0
    expected = 4 * 10 * sum(0.7 - w for w in work.values())  # 4 groups x 10 steps
    assert st["others_lost_s"] == pytest.approx(expected)
    assert [n["node"] for n in s.node_stragglers] == ["b"]
    assert s.shares["waiting_for_slowest"]["value"] == pytest.approx(expected / (4 * 4 * 10.0))


def test_malformed_lines_are_skipped_and_counted_never_fatal(tmp_path):
    f = record_path(tmp_path, "h", 0)
    good = _interval(100.0, 10, 1.0, None) | {"launch": "L", "rank": 0, "node": "h"}
    f.write_text("\n".join([json.dumps(good), "not json", "[1, 2]", json.dumps({"kind": "interval"}),
                            json.dumps({"kind": "weird", "t": 1}), "\x00\xff garbage", json.dumps(good)]) + "\n")
    s = summarise(tmp_path)
    assert s.read["skipped_lines"] == 5 and s.read["intervals"] == 2
    assert any("skipped" in n for n in s.notes)


def test_rotation_keeps_every_record_in_order(tmp_path):
    wr = RecordWriter(record_path(tmp_path, "h", 0), max_bytes=600)
    for i in range(20):
        wr.write(_interval(100.0 + i, i, 1.0, None) | {"launch": "L", "rank": 0, "node": "h"})
    wr.close()
    (rf,) = rank_files(tmp_path)
    assert len(rf.paths) > 2 and rf.paths[-1].name == "h-rank0.jsonl"
    assert summarise(tmp_path).read["intervals"] == 20


def test_queue_wait_from_slurm_and_its_share_of_the_wall_clock(tmp_path):
    text = ("JobId=42 JobName=train UserId=u(1) JobState=RUNNING Restarts=1 SubmitTime=2026-11-30T10:00:00 "
            "EligibleTime=2026-11-30T10:00:00 StartTime=2026-11-30T11:00:00 NodeList=n[1-2]")
    q = parse_scontrol(text)
    assert q["queue_wait_s"] == 3600.0 and q["Restarts"] == 1 and q["NodeList"] == "n[1-2]"
    start = q["StartTime"]
    wr = RecordWriter(record_path(tmp_path, "h", 0))
    wr.write({"kind": "start", "v": 1, "t": start, "launch": "L", "rank": 0, "node": "h"})
    wr.write({"kind": "cluster", "v": 1, "t": start + 1, "launch": "L", "rank": 0, "node": "h",
              "slurm": {"source": "scontrol", **q}})
    wr.write(_interval(start + 3600.0, 10, 3599.0, None) | {"launch": "L", "rank": 0, "node": "h"})
    wr.close()
    s = summarise(tmp_path)
    assert s.span["wall_clock_s"] == pytest.approx(7200.0)
    assert s.operations_loss["parts"]["queue"]["value"] == pytest.approx(0.5)


def test_formulas_union_throttle_and_launch_ids():
    assert union_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)
    assert union_seconds([]) == 0.0
    timer = CommTimer(cuda=False)
    timer._spans += [(0.0, 0.25), (0.1, 0.5)]
    assert timer.take() == pytest.approx(0.5) and timer.take() == 0.0
    timer._spans.append((0.0, 0.25))
    timer.discard()  # a step left out of the timing lends nothing to the next interval
    assert timer.take() == 0.0
    gpu = {"throttled_share": 0.5, "throttled_clock_ratio": 0.8}
    assert throttle_seconds({"wall_s": 100.0, "gpu": gpu}) == pytest.approx(100 * 0.5 * 0.2)
    env = {"TORCHELASTIC_RUN_ID": "x", "TORCHELASTIC_RESTART_COUNT": "2", "MASTER_ADDR": "m", "MASTER_PORT": "1"}
    assert launch_id(env) == "torchrun:x:m:1#2" and launch_id({"SLURM_JOB_ID": "7"}) == "slurm:7.#0"


def test_flops_counted_on_the_first_step_match_the_formula_and_mfu_uses_them(tmp_path):
    b, w, layers = 8, 32, 3
    model = torch.nn.Sequential(*[torch.nn.Linear(w, w) for _ in range(layers)])
    with Monitor(tmp_path, model=model, every=4, peak_flops=1e9, profile_every_s=None) as mon:
        for x in mon.loader(torch.randn(b, w) for _ in range(9)):
            model(x).sum().backward()
            mon.step(tokens=b)
    recs = records(next(tmp_path.glob("*.jsonl")))
    (fl,) = [r for r in recs if r["kind"] == "flops"]
    # forward 2bw^2 per layer, backward 4bw^2 (input and weight grads) except the first layer's input grad
    assert fl["per_step"] == layers * 6 * b * w * w - 2 * b * w * w
    for r in (r for r in recs if r["kind"] == "interval"):
        assert r["mfu"] == pytest.approx(fl["per_token"] * r["tokens"] / (r["wall_s"] * 1e9))
        assert r["comm_s"] is None  # not DDP: nothing timed, not a zero


def test_monitor_rejects_bad_settings_by_name(tmp_path):
    with pytest.raises(ValueError, match="every"):
        Monitor(tmp_path, every=0)
    with pytest.raises(ValueError, match="dtype"):
        Monitor(tmp_path, dtype="fp8")
    with pytest.raises(JobError, match="monitor_dir"):
        from mfu_lab.steps import monitor

        monitor.run("")


def test_the_jobs_own_ddp_hook_is_kept_and_timed_and_an_unwrapped_one_is_named(tmp_path):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        calls = []

        def own_hook(state, bucket):
            calls.append(bucket.index())
            return default_hooks.allreduce_hook(state, bucket)

        model = DDP(torch.nn.Linear(16, 16))
        mon = Monitor(tmp_path / "a", model=model, every=3, peak_flops=1e9, profile_every_s=None)
        model.register_comm_hook(None, mon.wrap_hook(own_hook))
        with mon:
            for x in mon.loader(torch.randn(4, 16) for _ in range(7)):
                model(x).sum().backward()
                mon.step(tokens=4)
        recs = records(next((tmp_path / "a").glob("*.jsonl")))
        assert recs[0]["comm"]["timed"] and "own communication hook" in recs[0]["comm"]["how"]
        assert len(calls) == 7  # the job's hook ran on every step, through the timer
        assert all(r["comm_s"] is not None and r["comm_s"] > 0 for r in recs if r["kind"] == "interval")

        builtin = DDP(torch.nn.Linear(16, 16))
        builtin._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)  # not listed in _comm_hooks
        with Monitor(tmp_path / "c", model=builtin, every=3, peak_flops=1e9, profile_every_s=None):
            pass
        start = records(next((tmp_path / "c").glob("*.jsonl")))[0]
        assert not start["comm"]["timed"] and "refused" in start["comm"]["how"]

        other = DDP(torch.nn.Linear(16, 16))
        other.register_comm_hook(None, own_hook)  # not wrapped: DDP takes one hook, so it cannot be timed
        with Monitor(tmp_path / "b", model=other, every=3, peak_flops=1e9, profile_every_s=None):
            pass
        start = records(next((tmp_path / "b").glob("*.jsonl")))[0]
        assert not start["comm"]["timed"] and "wrap_hook" in start["comm"]["how"]
    finally:
        dist.destroy_process_group()


def test_tensorboard_gets_the_same_figures_when_asked(tmp_path):
    pytest.importorskip("tensorboard")
    model = torch.nn.Linear(8, 8)
    with Monitor(tmp_path, model=model, every=2, peak_flops=1e9, profile_every_s=None, tensorboard=True) as mon:
        for x in mon.loader(torch.randn(2, 8) for _ in range(5)):
            model(x).sum().backward()
            mon.step(tokens=2)
    assert list((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert records(next(tmp_path.glob("*.jsonl")))[0]["tensorboard"].startswith("writing to")


def test_the_index_shows_the_monitor_and_its_operations_loss_enters_the_ledger(tmp_path, two_ranks):
    from mfu_lab.core.store.files import write_json_atomic
    from mfu_lab.report import write_index
    from mfu_lab.report.index import _ledgers
    from mfu_lab.steps import monitor

    monitor.run(two_ranks)  # summary.json beside the records
    mfu = 0.4
    result = {"step": "baseline", "job": {"job_name": "j", "monitor_dir": str(two_ranks)},
              "environment": {"device_name": "cpu0", "created_at": "2026-12-01T00:00:00", "git_commit": "abc"},
              "metrics": {}, "advice": [],
              "ledger": {"items": [{"name": "mfu", "fraction": mfu, "source": "measured", "explanation": ""},
                                   {"name": "hardware", "fraction": 1 - mfu, "source": "measured", "explanation": ""},
                                   {"name": "operations", "fraction": 0.0, "source": "analytic",
                                    "explanation": "unknown"}]}}
    write_json_atomic(tmp_path / "01_baseline" / "result.json", result)
    page = write_index(tmp_path).read_text()
    assert "Step 0 · the job in production" in page and "waiting for data" in page
    ops = json.loads((two_ranks / "summary.json").read_text())["operations_loss"]["total"]["value"]
    assert ops > 0
    from mfu_lab.report.summary import with_operations

    scaled = with_operations(result["ledger"], ops, "x")
    parts = {i["name"]: i["fraction"] for i in scaled["items"]}
    assert sum(parts.values()) == pytest.approx(1.0)
    assert parts["operations"] == pytest.approx(ops) and parts["mfu"] == pytest.approx(mfu * (1 - ops))
    assert _ledgers({"baseline": result}, json.loads((two_ranks / "summary.json").read_text()))["ops"]
    # a job naming a folder with no summary says how to make one, instead of nothing
    result["job"]["monitor_dir"] = str(tmp_path / "elsewhere")
    write_json_atomic(tmp_path / "01_baseline" / "result.json", result)
    assert "mfu-lab monitor report" in write_index(tmp_path).read_text()


def test_a_record_that_cannot_be_written_never_stops_training(tmp_path):
    model = torch.nn.Linear(4, 4)
    mon = Monitor(tmp_path, model=model, every=2, peak_flops=1e9, profile_every_s=None).start()

    def full_disk(record):
        raise OSError(28, "No space left on device")

    mon._writer.write = full_disk
    with pytest.warns(UserWarning, match="No space left"):
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
            mon.step(tokens=2)
    assert mon.write_errors == 2  # the FLOPs counted over step 2, then the interval of steps 3-4
    mon.close()
    mon.step(tokens=2)  # after close: nothing, no error
    wr = RecordWriter(record_path(tmp_path / "nan", "h", 0))
    wr.write({"kind": "interval", "t": 1.0, "mfu": float("nan"), "x": [float("inf")]})
    wr.close()
    assert records(next((tmp_path / "nan").glob("*.jsonl")))[0] | {} == {"kind": "interval", "t": 1.0, "mfu": None,
                                                                          "x": [None]}


@pytest.mark.e2e
def test_a_run_whose_job_names_monitor_dir_reads_it_first(full_run):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    assert "[0] 00_monitor" in p.stdout and "[0] 00_monitor: not read" not in p.stderr
    step = job_root / "00_monitor"
    assert json.loads((step / "summary.json").read_text())["start_with"] == "baseline"
    nb = json.loads((step / "00_monitor.ipynb").read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    index = (job_root / "index.html").read_text()
    assert "Step 0 · the job in production" in index and 'href="00_monitor/report.html"' in index
    assert "The operations bar is the loss the production monitor measured" in index
