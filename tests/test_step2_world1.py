"""Step 2 at world size 1 (issue 46, 'Give step 2 no DDP half at world size 1'): one rank has no gradient
communication to tune, so the DDP half starts no process and takes no time, the result says why as a skip reason
(no DDP row, race or figure), and the attention half plans with the whole of step 2's share instead of half."""

import dataclasses
import json

import pytest

from mfu_lab.core.measure import device as dev
from mfu_lab.core.process.budget import Clock
from mfu_lab.core.process.progress import Progress
from mfu_lab.steps.attention_comm import attention_race, comm_race
from mfu_lab.steps.attention_comm import step as step2
from mfu_lab.workers import launch

ONE_RANK = "world size 1: no gradient communication to tune"


class FrozenClock(Clock):
    """A share whose time left never moves: what the step plans does not depend on this machine's speed."""

    def left_s(self):
        return self.planned_s


def _no_ddp(monkeypatch):
    """Every way step 2 starts DDP processes fails the test if it is taken."""
    def never(*a, **k):
        raise AssertionError("step 2 started its DDP half at world size 1")

    for mod, name in ((step2, "race_ddp"), (step2, "confirm_pick"), (comm_race, "run_sweep"),
                      (comm_race, "alternate"), (launch, "launch"), (launch, "run_sweep")):
        monkeypatch.setattr(mod, name, never)


@pytest.fixture
def one_rank(tiny_job, monkeypatch):
    job = dataclasses.replace(tiny_job, nproc_per_node=1, steps=4, warmup_steps=1, race_steps=2)
    _no_ddp(monkeypatch)
    seen = {}
    real = attention_race.attention_section

    def section(*a, **k):
        seen["ddp_half"] = k.get("ddp_half")
        return real(*a, **k)

    monkeypatch.setattr(step2, "attention_section", section)
    lines: list[str] = []
    r = step2.run(job, progress=lines.append)
    return job, r, seen, lines


def test_world_size_1_starts_no_ddp_process_and_records_why(one_rank):
    job, r, seen, lines = one_rank
    assert r.comm_layout["world_size"] == 1 and r.comm_layout["launches"] == []
    assert r.comm_layout["skipped"].startswith(ONE_RANK)
    assert {"what": "DDP sweep and all-reduce benchmark", "reason": r.comm_layout["skipped"]} in r.skipped
    # no figure made up for a sweep that did not run: no rows, no race, no bandwidth, no ledger, no recommendation
    assert r.comm == [] and r.allreduce == [] and r.ledger is None and r.races["ddp"] is None
    assert "comm" not in r.recommendation and "comm_text" not in r.recommendation
    for key in ("ddp_mfu", "ddp_step_median_s", "exposed_comm_share", "allreduce_busbw_max_gbps"):
        assert r.metrics[key].value is None, key
    assert not (job.step_dir(step2.INFO.folder) / "ddp").exists()  # not even the launcher's folder
    # the attention half ran, and planned with the whole share: nothing held back for a DDP race
    assert seen["ddp_half"] is False and any(a.status == "ok" for a in r.attention)
    said = [ln for ln in lines if ln.startswith("communication")]
    assert said == [f"communication: skipped, {r.comm_layout['skipped']}"]  # said once, plainly
    assert any(a.message == "No data parallelism was tuned: " + r.comm_layout["skipped"] for a in r.advice)


def test_world_size_1_result_round_trips_and_reports(one_rank):
    job, r, _, _ = one_rank
    d = json.loads((job.step_dir(step2.INFO.folder) / "result.json").read_text())
    back = step2.AttentionCommResult.from_dict(d)
    assert back.races["ddp"] is None and back.comm == [] and back.comm_layout["skipped"].startswith(ONE_RANK)
    from mfu_lab.report.tables.attention_comm import attention_comm_section

    html = str(attention_comm_section(d))
    assert ONE_RANK in html and "How the ddp sweep ran" not in html
    from mfu_lab import plots

    drawn = plots.comm_sweep(back)  # the notebook's cell: no empty axes, the reason instead
    assert not drawn and repr(drawn) == "Not drawn: No communication to draw: " + back.comm_layout["skipped"]


def test_two_ranks_keep_the_ddp_half():
    """The default CPU job runs its DDP half with 2 gloo ranks on purpose (nproc_per_node 0: 2 on a CPU)."""
    from mfu_lab.core.job.schema import Job

    assert comm_race.ddp_half_runs(Job(), "cpu") == (True, "")
    runs, why = comm_race.ddp_half_runs(Job(nproc_per_node=1), "cpu")
    assert not runs and why.startswith(ONE_RANK) and "1 x 1" in why
    runs, why = comm_race.ddp_half_runs(Job(nproc_per_node=2, dp_mode="fsdp"), "cpu")
    assert not runs and "FSDP2" in why  # the job's own layout: DDP's settings are not raced either


@pytest.mark.parametrize("ddp_half, share", [(True, 50.0), (False, 100.0)])
def test_the_attention_final_round_holds_back_half_only_for_a_ddp_race(monkeypatch, tiny_job, ddp_half, share):
    """Under a budget the attention final round fits half of step 2's share left when the DDP race follows it, and
    all of it at world size 1 (no DDP race); the share is frozen, so the machine's speed does not matter."""
    job = dataclasses.replace(tiny_job, steps=4, warmup_steps=1, race_steps=2)
    given = []
    real = attention_race.fit_count
    monkeypatch.setattr(attention_race, "fit_count", lambda left, *a, **k: given.append(left) or real(left, *a, **k))
    device = dev.resolve_device("cpu")
    attention_race.attention_section(job, device, device.torch_device, 1e9, 1e11, Progress(lambda m: None, bar=False),
                                     FrozenClock(100.0), ddp_half=ddp_half)
    assert given == [share]


def test_a_budget_cut_at_world_size_1_says_no_ddp_race_follows(tiny_job):
    job = dataclasses.replace(tiny_job, steps=12, warmup_steps=1, race_steps=2)
    device = dev.resolve_device("cpu")
    clock = FrozenClock(0.0)
    attention_race.attention_section(job, device, device.torch_device, 1e9, 1e11, Progress(lambda m: None, bar=False),
                                     clock, ddp_half=False)
    cut = {s["what"]: s["reason"] for s in clock.shortened}
    assert "no DDP race runs after it" in cut["attention final steps"] and "half" not in cut["attention final steps"]


def test_a_reason_several_ddp_candidates_share_is_said_once_under_the_table():
    """A budget's cut gives ten candidates one long reason: said once, each row pointing to it (the default run's
    table was 4,100 px tall with the same sentence in every row); a reason of one candidate stays in its row."""
    from mfu_lab.report.tables.attention_comm import comm_table
    from mfu_lab.steps.attention_comm.comm_rows import CommRow

    cut, refused = "budget: not screened (15 s, half of the 30 s left)", "gloo: bf16_compress_hook needs NCCL"
    rows = [CommRow("none", 25, False, "ok", step_median_s=0.6)]
    rows += [CommRow(h, 25, False, "skipped", error=cut) for h in ("allreduce", "fp16_compress", "powersgd")]
    rows += [CommRow("bf16_compress", 25, False, "unsupported", error=refused)]
    html = str(comm_table(rows))
    assert html.count(cut) == 1 and html.count("note 1 below") == 3
    assert f'<p class="table-note"><small>Note 1, 3 candidates: {cut}</small></p>' in html
    assert html.count(refused) == 1 and "note 2" not in html  # its own reason, in its row
