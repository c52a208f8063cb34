"""Property-based: whatever changes the steps adopt, in whatever combination, the tuned job is one the validator
accepts and every rung of step 7's staircase is too (a suite run's step 7 once failed on compile_mode default
beside loss_impl chunked, each adopted by its own race of step 4)."""

import dataclasses

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed: pip install -e '.[test]'")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mfu_lab.analysis import tuning  # noqa: E402
from mfu_lab.analysis.result_keys import MAY_SET, refusal  # noqa: E402
from mfu_lab.core.errors import JobError  # noqa: E402
from mfu_lab.core.job.schema import FIELDS, load_job, validate  # noqa: E402
from tests.conftest import TINY  # noqa: E402

READERS = sorted(k for k in MAY_SET if k not in ("rechecked", "withdrawn"))
FSDP_KEYS = ("dp_mode", "fsdp_reshard_after_forward", "fsdp_prefetch", "fsdp_reduce_dtype")


def _rung(reader: str, key: str) -> str:
    """The rung a reader's change sits on (tuning's readers): step 2's FSDP2 pick is a layout change."""
    return "layout" if reader == "communication" and key in FSDP_KEYS else reader


def _values(key: str):
    meta, kind = FIELDS[key].metadata, MAY_SET["withdrawn"].keys[key]
    if "choices" in meta:
        return st.sampled_from(meta["choices"])
    if kind is bool:
        return st.booleans()
    if kind is int:
        return st.integers(meta.get("min", 1), meta.get("min", 1) + 8)
    if kind is float:
        return st.sampled_from([0.05, 1.0, 25.0])
    return st.lists(st.sampled_from(["attn_qkv", "attn_out", "mlp", "lm_head"]), max_size=3, unique=True)


@st.composite
def changes(draw):
    """Changes as tuning's readers give them (one step's decision per rung, in the staircase's order), then
    step 7's withdrawals of some of them (read last, back to the job's value)."""
    out, seen = [], set()
    for _ in range(draw(st.integers(0, 8))):
        reader = draw(st.sampled_from(READERS))
        key = draw(st.sampled_from(sorted(MAY_SET[reader].keys)))
        new = draw(_values(key))
        if refusal(reader, key, new) is None and (reader, key) not in seen:  # a refused value never reaches tuning
            seen.add((reader, key))
            out.append(tuning.Change(_rung(reader, key), reader, key, None, new, "drawn",
                                     draw(st.sampled_from(["measured", "proposed"]))))
    out.sort(key=lambda c: tuning.RUNGS.index(c.rung))
    early = draw(st.lists(st.sampled_from(out), unique_by=id, max_size=1)) if out else []  # left out before timing
    back = draw(st.lists(st.sampled_from(out), unique_by=id, max_size=2)) if out else []
    back = [c for b in back for c in out if c.rung == b.rung and c.step == b.step]  # step 7 withdraws whole rungs
    return out + [tuning.Change(c.rung, "verify", c.key, c.new, None, "drawn", "measured",
                                reason=f"{tuning.WITHDRAWN} {tuning.BEFORE_TIMING[0]}: drawn") for c in early] + [
        tuning.Change(c.rung, "verify", c.key, c.new, None, "drawn", "measured", reason=f"{tuning.WITHDRAWN}: drawn")
        for c in {id(c): c for c in back}.values()]


@st.composite
def jobs(draw):
    values = load_job(TINY).to_dict() | {
        "loss_impl": draw(st.sampled_from(FIELDS["loss_impl"].metadata["choices"])),
        "compile_mode": draw(st.sampled_from(["off", "default"])),
        "grad_accum": draw(st.integers(1, 4)), "micro_batch": draw(st.sampled_from([2, 4, 8]))}
    try:
        return validate(values, "drawn job")
    except JobError:
        hypothesis.assume(False)


@settings(max_examples=1000, deadline=None)
@given(job=jobs(), drawn=changes())
def test_the_tuned_job_and_every_rung_are_valid_whatever_was_adopted(job, drawn):
    for c in drawn:
        c.old = getattr(job, c.key)
        if c.step == "verify":
            c.new = c.old
    drawn = [c for c in drawn if c.step == "verify" or c.new != c.old]  # a reader never proposes the job's value
    groups = {}
    for c in drawn:
        groups.setdefault((c.rung, c.step), []).append(c)
    chosen = tuning.settle(job, drawn)  # as tuning.changes leaves them
    withdrawn = {(c.rung, c.key) for c in drawn if c.step == "verify"}
    for (rung, step), group in groups.items():  # a step's decision stands whole or not at all
        if step != "verify" and not any((rung, c.key) in withdrawn for c in group):
            standing = [any(x is c and x.adopted for x in chosen) for c in group]
            assert all(standing) or not any(standing), (rung, step, standing)
    tuned = tuning.tuned_job(job, chosen)  # raises if the combination is refused
    stairs = tuning.staircase(job, chosen)
    assert {k: v for k, v in stairs[-1][1].to_dict().items() if k != "job_name"} == \
        {k: v for k, v in tuned.to_dict().items() if k != "job_name"}
    for c in chosen:
        assert c.adopted or c.reason.startswith((tuning.CLASH_REASON, tuning.BESIDE_LAYOUT))
    timed = [id(c) for _, _, mine in stairs for c in mine]
    assert sorted(timed) == sorted(id(c) for c in chosen if c.adopted)  # each adopted change on exactly one rung
    for _, _, mine in stairs:  # one step's decision (a split, a layout) is never torn across rungs
        for c in mine:
            assert all(any(x is m for m in mine) for x in chosen if x.adopted and (x.rung, x.step) == (c.rung, c.step))
    before = tuning.settle(job, [dataclasses.replace(c, adopted=True, reason="") for c in drawn if c.step != "verify"])
    untimed = {c.key for c in drawn if c.reason.startswith(f"{tuning.WITHDRAWN} {tuning.BEFORE_TIMING[0]}")}
    for c in before:  # step 7 as it runs: the steps' changes settled, its own leaving-out, its guard, then timing
        if c.key in untimed:
            c.adopted = False
    timed = {(c.rung, c.step, c.key) for c in tuning.combinable(job, before) if c.adopted}
    assert {(c.rung, c.step, c.key) for c in chosen if c.adopted} <= timed  # nothing adopted that step 7 never timed
    if len(before) < len(drawn):  # step 7 withdrew some: what it made room for stays out (above), not minimal
        return
    for c in chosen:  # nothing left out that could stand: each dropped step's changes, put back, are refused
        if not c.adopted and c.reason.startswith(tuning.CLASH_REASON):
            group = [x for x in chosen if (x.rung, x.step, x.reason) == (c.rung, c.step, c.reason)]
            for x in group:
                x.adopted = True
            with pytest.raises(JobError):
                tuning.tuned_job(job, chosen)
            for x in group:
                x.adopted = False
