"""Property-based: whatever changes the steps adopt, in whatever combination, the tuned job is one the validator
accepts and every rung of step 7's staircase is too (a suite run's step 7 once failed on compile_mode default
beside loss_impl chunked, each adopted by its own race of step 4)."""

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed: pip install -e '.[test]'")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from mfu_lab.analysis import tuning  # noqa: E402
from mfu_lab.analysis.result_keys import MAY_SET, refusal  # noqa: E402
from mfu_lab.core.errors import JobError  # noqa: E402
from mfu_lab.core.job.schema import FIELDS, load_job, validate  # noqa: E402
from tests.conftest import TINY  # noqa: E402

READER_RUNG = {"attention": "attention", "communication": "communication", "layout": "layout", "data": "data",
               "optimizer": "optimizer", "batch": "batch", "compile": "compile", "loss": "loss",
               "precision": "precision", "fp8": "fp8"}


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
    out = []
    for _ in range(draw(st.integers(0, 8))):
        reader = draw(st.sampled_from(sorted(READER_RUNG)))
        key = draw(st.sampled_from(sorted(MAY_SET[reader].keys)))
        new = draw(_values(key))
        if refusal(reader, key, new) is None:  # what a result may not set never reaches the tuned job
            out.append(tuning.Change(READER_RUNG[reader], reader, key, None, new, "drawn",
                                     draw(st.sampled_from(["measured", "proposed"]))))
    return sorted(out, key=lambda c: tuning.RUNGS.index(c.rung))  # tuning.changes lists them in the staircase's order


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
    chosen = tuning.combinable(job, tuning._batch_beside_layout(drawn))  # as tuning.changes applies them
    tuned = tuning.tuned_job(job, chosen)  # raises if the combination is refused
    stairs = tuning.staircase(job, chosen)
    assert {k: v for k, v in stairs[-1][1].to_dict().items() if k != "job_name"} == \
        {k: v for k, v in tuned.to_dict().items() if k != "job_name"}
    for c in chosen:
        assert c.adopted or c.reason.startswith((tuning.CLASH_REASON, tuning.BESIDE_LAYOUT))
    timed = [id(c) for _, _, mine in stairs for c in mine]
    assert sorted(timed) == sorted(id(c) for c in chosen if c.adopted)  # each adopted change on exactly one rung
