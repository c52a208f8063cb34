"""What a job's batches hold, read once from its first batch: token ids or not, and how many samples; and the rates a
step's figures derive from them (tokens/s for token ids only, samples/s always). Issue 47: any batch the job's own
loss understands (:mod:`mfu_lab.core.engine.batches`). And the batches of a side-by-side comparison, the same for every
candidate (:func:`same_batches`)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import torch

from mfu_lab.core.engine.batches import Batch, Rest, samples_of
from mfu_lab.core.engine.data import build_loader, data_kind
from mfu_lab.core.job.factories import source_digest
from mfu_lab.core.job.schema import Job
from mfu_lab.core.store.results import Metric

NO_TOKENS = "the batches are not token ids: no tokens; see samples_per_s"

_FIRST: dict[str, tuple[bool, int]] = {}


def first_batch_facts(job: Job) -> tuple[bool, int]:
    """(token ids?, samples) of the job's first batch: every data kind mfu-lab reads itself gives token ids,
    ``micro_batch`` rows; a factory's batch is drawn once per process, in this process (no loader worker)."""
    if data_kind(job) != "factory":
        return True, job.micro_batch


    key = json.dumps([job.data, job.model, job.loss, job.vocab_size, job.model_kwargs, job.factory_paths, job.trust,
                      job.micro_batch, job.seed], sort_keys=True, default=str)
    if key not in _FIRST:
        feed = build_loader(dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0), 1, "cpu")
        batch = next(iter(feed))
        _FIRST[key] = (bool(getattr(batch, "tokens", True)), samples_of(batch))
    return _FIRST[key]


def token_job(job: Job) -> bool:
    """Whether the job trains on token ids (tokens/s and padding mean something): :func:`first_batch_facts`."""
    return first_batch_facts(job)[0]


def work_rates(job: Job, steps_per_s: float | None, ranks: int = 1) -> tuple[float | None, float | None]:
    """(tokens/s, samples/s) at ``steps_per_s`` steps a second over ``ranks`` data-parallel ranks: tokens only for
    a job on token ids (``tokens_per_step``), samples always (:func:`samples_per_step`)."""
    if not steps_per_s:
        return None, None
    tokens = job.tokens_per_step * ranks * steps_per_s if token_job(job) else None
    return tokens, samples_per_step(job) * ranks * steps_per_s


def samples_per_step(job: Job) -> int:
    """Samples of one optimizer step on one rank: the first batch's (:func:`first_batch_facts`) x ``grad_accum``."""
    return first_batch_facts(job)[1] * job.grad_accum


def rate_metrics(job: Job, steps_per_s: float | None, over: str, ranks: int = 1,
                 tokens_how: str = "tokens per step x steps / wall time") -> dict[str, Metric]:
    """``tokens_per_s`` and ``samples_per_s`` as a step's metrics (:func:`work_rates`), both measured ``over`` the
    steps it names; tokens/s empty, and said so, for a job whose batches are not token ids."""
    tokens_per_s, samples_per_s = work_rates(job, steps_per_s, ranks)
    return {"tokens_per_s": Metric(tokens_per_s, "tokens/s", "measured",
                                   f"{tokens_how}, {over}" if first_batch_facts(job)[0] else NO_TOKENS),
            "samples_per_s": Metric(samples_per_s, "samples/s", "measured",
                                    f"samples per step x steps / wall time, {over}")}


def same_batches(job: Job, n_batches: int, device_type: str, rank: int = 0, world: int = 1) -> Any:
    """The batches of a side-by-side comparison (steps 2, 4, 5 and 7), the same for every candidate, in any process.

    mfu-lab's own loaders give the same batches on every call (seeded windows, rows in order, a map-style dataset
    unshuffled): they are returned as they are, data wait included. A factory's own DataLoader or iterable may
    shuffle: its first ``n_batches`` are drawn once, saved under ``<out>/<job>/.batches/`` and read back by every
    later candidate (none then waits on data: they compare compute), keyed on all they depend on, its source too."""
    feed = build_loader(job, n_batches, device_type, rank=rank, world=world)
    if not getattr(feed, "fixed", ()):
        return feed
    import hashlib
    import json
    import os

    key = hashlib.sha256(json.dumps([job.data, source_digest(job.data, job.factory_paths, job.trust),
                                     job.factory_paths, job.trust, job.micro_batch, job.seq_len, job.seed, n_batches,
                                     job.grad_accum, rank, world]).encode()).hexdigest()[:16]
    path = job.output_root() / ".batches" / f"{key}.pt"
    if path.is_file():
        try:
            return [Batch(x, Rest(y) if rest else y, kw, tokens)
                    for x, y, kw, tokens, rest in torch.load(path, weights_only=True)]
        except Exception:  # a torn or foreign file: drawn again below
            pass
    batches = list(feed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    torch.save([(b[0], tuple(b[1]) if isinstance(b[1], Rest) else b[1], b.kwargs, getattr(b, "tokens", True),
                 isinstance(b[1], Rest)) for b in batches], tmp)
    os.replace(tmp, path)
    return batches
