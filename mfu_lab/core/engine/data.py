"""The job's data: what the ``data`` key names, through a real DataLoader, as the batches every step trains on.

- ``synthetic`` / ``synthetic_varlen``: seeded random token ids (lengths varying in [min_seq_len, seq_len]);
- ``tokens:PATH``: a flat binary token file as nanoGPT's ``prepare.py`` writes it (``train.bin``), read with
  ``numpy.memmap`` (``data_dtype``); each sample is a window of seq_len + 1 tokens at a seeded random offset, so a
  rerun sees the same batches;
- ``hf:PATH``: a Hugging Face dataset saved with ``save_to_disk``, read offline with ``datasets.load_from_disk``;
  ``data_column`` holds token ids, or text that ``tokenizer`` (a saved tokenizer's folder) turns into ids;
- ``package.module:function``: the user's own factory (the model factory's rule, :mod:`mfu_lab.core.job.factories`),
  returning a ``Dataset``, an ``IterableDataset``, a ``DataLoader`` or any iterable of batches; it gets ``rank``
  and ``world_size`` when it accepts them.

A map-style dataset is split over data-parallel ranks by ``DistributedSampler``; an iterable dataset, a user's
DataLoader or a plain iterable is used as it is on every rank, so each rank may see the same batches
(:attr:`Feed.notes` says so). Every batch is made a :class:`~mfu_lab.core.engine.batches.Batch` and checked
(:func:`~mfu_lab.core.engine.batches.checked_batch`: on the host, before it is moved, every batch).
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from mfu_lab.core.engine.batches import (
    IGNORE,  # the target id cross_entropy skips: padding
    checked_batch,
    input_embedding,
)
from mfu_lab.core.errors import StepError
from mfu_lab.core.job.factories import load_factory
from mfu_lab.core.job.paths import input_path
from mfu_lab.core.job.rules import DATA_PREFIXES, DATA_SOURCES
from mfu_lab.core.job.schema import Job

LOADER_KNOBS = ("num_workers", "prefetch_factor", "pin_memory", "persistent_workers")


def data_kind(job: Job) -> str:
    """synthetic | synthetic_varlen | tokens | hf | factory."""
    if job.data in DATA_SOURCES:
        return job.data
    prefix = next((p for p in DATA_PREFIXES if job.data.startswith(p)), None)
    return prefix[:-1] if prefix else "factory"


def data_path(job: Job) -> Path:
    """The file or folder of ``tokens:PATH`` / ``hf:PATH`` (relative: as the job's other paths)."""
    return input_path(job.data.split(":", 1)[1].strip(), "data")


@lru_cache(maxsize=8)
def _factory_vocab(model: str, kwargs: str, factory_paths: tuple, trust: tuple) -> int:
    import json

    with torch.device("meta"):
        m = load_factory(model, None, list(factory_paths), list(trust))(**json.loads(kwargs))
    emb, _ = input_embedding(m)
    if emb is None:
        raise StepError(f"vocab_size is 0 (take it from the model), but model: {model} has no input embedding "
                        "(nn.Embedding) to read it from; set vocab_size in the job")
    return emb.num_embeddings


def job_vocab(job: Job) -> int:
    """The job's vocabulary: ``vocab_size``, or for 0 the model's input embedding rows (the model built on the
    meta device: no memory, no weights)."""
    if job.vocab_size:
        return job.vocab_size
    import json

    return _factory_vocab(job.model, json.dumps(job.model_kwargs, sort_keys=True, default=str),
                          tuple(job.factory_paths), tuple(job.trust))


# ------------------------------------------------------------------ synthetic
class SyntheticTokens(Dataset):
    """Seeded random token ids; sample i is the same on every run and in every worker.

    ``load_ms`` sleeps that long per batch (spread over its samples) to stand in
    for storage or decoding latency, so a slow loader can be demonstrated.
    """

    def __init__(self, n_samples: int, seq_len: int, vocab_size: int, seed: int, load_ms_per_sample: float = 0.0):
        self.n, self.seq_len, self.vocab, self.seed = n_samples, seq_len, vocab_size, seed
        self.load_s = load_ms_per_sample / 1000.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.load_s:
            time.sleep(self.load_s)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        tokens = torch.randint(self.vocab, (self.seq_len + 1,), generator=g)
        return tokens[:-1], tokens[1:]


PAD_ID = 0  # input id of padding positions


class VarLenTokens(SyntheticTokens):
    """Seeded random token sequences of varying length, uniform in [min_len, seq_len]."""

    def __init__(self, n_samples: int, seq_len: int, min_len: int, vocab_size: int, seed: int,
                 load_ms_per_sample: float = 0.0):
        super().__init__(n_samples, seq_len, vocab_size, seed, load_ms_per_sample)
        self.min_len = min_len

    def length(self, i: int) -> int:
        g = torch.Generator().manual_seed(self.seed * 7_000_003 + i)
        return int(torch.randint(self.min_len, self.seq_len + 1, (1,), generator=g))

    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        n = self.length(i)
        return x[:n], y[:n]


class PackedTokens(Dataset):
    """Variable-length samples laid end to end and cut into rows of exactly seq_len tokens (no padding)."""

    def __init__(self, source: VarLenTokens, n_rows: int):
        self.src, self.n, self.seq_len = source, n_rows, source.seq_len
        self.starts = [0]  # stream offset where each source sample starts
        i = 0
        while self.starts[-1] < n_rows * self.seq_len:
            self.starts.append(self.starts[-1] + source.length(i))
            i += 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, r: int):
        lo, hi = r * self.seq_len, (r + 1) * self.seq_len
        xs, ys = [], []
        for i in range(len(self.starts) - 1):
            s, e = self.starts[i], self.starts[i + 1]
            if e <= lo or s >= hi:
                continue
            x, y = self.src[i]
            a, b = max(lo, s) - s, min(hi, e) - s
            xs.append(x[a:b])
            ys.append(y[a:b])
        return torch.cat(xs), torch.cat(ys)


def bucket_lengths(seq_len: int, buckets: int) -> list[int]:
    """``buckets`` lengths evenly spaced up to seq_len, each rounded up to a multiple of 8."""
    out = set()
    for k in range(1, buckets + 1):
        length = math.ceil(seq_len * k / buckets)
        out.add(min(seq_len, math.ceil(length / 8) * 8))
    return sorted(out)


@dataclass
class Collate:
    """Batch samples of different lengths into one (batch, length) tensor pair: padded to the longest
    sample ('longest'), to seq_len ('pad'), or to the next bucket length ('bucket'). With
    ``fill_to`` set, a short last batch gets rows of padding (targets ignored) up to that size."""

    policy: str
    seq_len: int
    buckets: list[int]
    fill_to: int = 0

    def __call__(self, samples):
        longest = max(len(x) for x, _ in samples)
        if self.policy == "pad":
            length = self.seq_len
        elif self.policy == "bucket":
            length = min([b for b in self.buckets if b >= longest] or [self.seq_len])
        else:
            length = longest
        rows = max(len(samples), self.fill_to)
        x = torch.full((rows, length), PAD_ID, dtype=torch.long)
        y = torch.full((rows, length), IGNORE, dtype=torch.long)
        for i, (xi, yi) in enumerate(samples):
            x[i, :len(xi)], y[i, :len(yi)] = xi, yi
        return x, y



class TokenFile(Dataset):
    """Windows of seq_len + 1 tokens of a flat token file at seeded random offsets (nanoGPT's ``get_batch``); the
    file is opened in each process that reads it (a memmap is not sent to DataLoader workers)."""

    def __init__(self, path: Path, dtype: str, n_samples: int, seq_len: int, seed: int, rank: int = 0,
                 load_ms_per_sample: float = 0.0):
        self.path, self.dtype, self.n, self.seq_len = Path(path), dtype, n_samples, seq_len
        self.tokens = self.path.stat().st_size // np.dtype(dtype).itemsize
        if self.tokens < seq_len + 2:
            raise StepError(f"data: tokens:{path} holds {self.tokens:,} tokens; a sample takes seq_len + 1 "
                            f"({seq_len + 1})")
        rng = np.random.default_rng([seed, rank])
        self.offsets = rng.integers(0, self.tokens - seq_len - 1, size=n_samples)
        self.load_s = load_ms_per_sample / 1000.0
        self._data = None

    def __getstate__(self):
        return {**self.__dict__, "_data": None}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.load_s:
            time.sleep(self.load_s)
        if self._data is None:
            self._data = np.memmap(self.path, dtype=self.dtype, mode="r")
        o = int(self.offsets[i])
        chunk = torch.from_numpy(self._data[o:o + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class HFRows(Dataset):
    """Rows of a saved Hugging Face dataset as (inputs, targets) of up to seq_len tokens: the ``column``'s token ids,
    or its text through ``tokenizer``. Index i reads row i modulo the rows, so a short dataset runs in epochs."""

    def __init__(self, path: Path, column: str, seq_len: int, tokenizer: str = "", load_ms_per_sample: float = 0.0):
        try:
            import datasets
        except ImportError:
            raise StepError("data: hf:PATH reads a dataset with the 'datasets' package, which is not installed: "
                            "pip install datasets") from None
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            split = "train" if "train" in ds else next(iter(ds))
            ds = ds[split]
        if column not in ds.column_names:
            raise StepError(f"data_column: the dataset {path} has no column '{column}'; its columns are "
                            f"{', '.join(ds.column_names)}")
        if len(ds) == 0:
            raise StepError(f"data: hf:{path} has no rows")
        self.ds, self.column, self.seq_len, self.tok = ds, column, seq_len, None
        self.load_s = load_ms_per_sample / 1000.0
        if tokenizer:
            from transformers import AutoTokenizer

            self.tok = AutoTokenizer.from_pretrained(str(input_path(tokenizer, "tokenizer")), local_files_only=True)

    def __len__(self) -> int:
        return len(self.ds)

    def ids(self, i: int) -> list[int]:
        value = self.ds[i % len(self.ds)][self.column]
        if isinstance(value, str):
            if self.tok is None:
                raise StepError(f"data_column '{self.column}' holds text; set tokenizer to a saved tokenizer's "
                                "folder, or name a column of token ids")
            value = self.tok(value)["input_ids"]
        return list(value)[:self.seq_len + 1]

    def length(self, i: int) -> int:
        return max(1, len(self.ids(i)) - 1)

    def __getitem__(self, i: int):
        if self.load_s:
            time.sleep(self.load_s)
        ids = self.ids(i)
        if len(ids) < 2:  # a row of one token has no target: one position of padding
            return torch.tensor([PAD_ID]), torch.tensor([IGNORE])
        t = torch.tensor(ids, dtype=torch.long)
        return t[:-1], t[1:]


# ------------------------------------------------------------------ the user's own data
def user_data(job: Job, rank: int = 0, world: int = 1) -> Any:
    """What the job's data factory returns, called with ``rank`` and ``world_size`` when it accepts them."""
    func = load_factory(job.data, None, job.factory_paths, job.trust, key="data")
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        params = {}
    kw = {k: v for k, v in (("rank", rank), ("world_size", world)) if k in params}
    return func(**kw)


@dataclass
class Feed:
    """Exactly ``n`` batches of a loader, epoch after epoch, each made a :class:`Batch` checked against ``bounds``.
    ``notes``: what the result should say about the data (ranks that may see the same batches, knobs it fixes)."""

    loader: Any
    n: int
    what: str
    sampler: Any = None
    load_s: float = 0.0
    notes: tuple[str, ...] = ()
    fixed: tuple[str, ...] = ()  # loader knobs the job cannot change (a user's own DataLoader)
    bounds: tuple[int, int] = (0, 0)  # (seq_len, vocabulary) every batch is checked against; 0: not that one
    ids: bool = True  # the model takes token ids: the token forms are tried first (core.engine.batches.as_batch)
    other: bool = False  # any other batch is taken as it is (the job names its loss, or the model has no embedding)

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        made = epoch = 0
        while made < self.n:
            if self.sampler is not None:
                self.sampler.set_epoch(epoch)
            got = 0
            for raw in self.loader:
                if self.load_s:
                    time.sleep(self.load_s)
                yield checked_batch(raw, made + 1, self.what, *self.bounds, self.ids, self.other)
                made, got = made + 1, got + 1
                if made == self.n:
                    return
            if got == 0:
                raise StepError(f"data: {self.what} gave no batch" + (f" after {made} (one pass), and the steps "
                                f"need {self.n}: return a re-iterable (a Dataset or DataLoader), not a one-shot "
                                "generator" if made else ""))
            epoch += 1


def _loader_kw(job: Job, device_type: str, workers: int | None = None) -> dict:
    w = job.num_workers if workers is None else workers
    return {"num_workers": w, "prefetch_factor": job.prefetch_factor if w else None,
            "pin_memory": job.pin_memory and device_type == "cuda",
            "persistent_workers": job.persistent_workers and w > 0}


# ------------------------------------------------------------------ the loader
def build_dataset(job: Job, n_samples: int, rank: int = 0) -> Dataset:
    """The dataset of the job's data kinds that mfu-lab reads itself (all but a factory)."""
    per_sample_ms = job.synthetic_load_ms / job.micro_batch
    kind = data_kind(job)
    if kind == "synthetic":
        return SyntheticTokens(n_samples, job.seq_len, job_vocab(job), job.seed, per_sample_ms)
    if kind == "tokens":
        return TokenFile(data_path(job), job.data_dtype, n_samples, job.seq_len, job.seed, rank, per_sample_ms)
    if kind == "hf":
        src = HFRows(data_path(job), job.data_column, job.seq_len, job.tokenizer, per_sample_ms)
    else:
        src = VarLenTokens(n_samples, job.seq_len, job.min_seq_len or max(1, job.seq_len // 2), job_vocab(job),
                           job.seed, per_sample_ms)
    return PackedTokens(src, n_samples) if job.seq_policy == "pack" else src


def build_loader(job: Job, n_batches: int, device_type: str, n_samples: int | None = None, rank: int = 0,
                 world: int = 1) -> Any:
    """The job's batches: ``n_batches`` optimizer steps' worth of full micro-batches (``grad_accum`` each), or
    exactly ``n_samples`` samples, through a DataLoader with the job's knobs. Synthetic data gives a DataLoader of
    (x, y) pairs; every other kind a :class:`Feed` of :class:`Batch` es (``rank`` of ``world`` data-parallel ranks:
    module docstring)."""
    kind = data_kind(job)
    want = n_samples if n_samples is not None else n_batches * getattr(job, "grad_accum", 1) * job.micro_batch
    if kind == "factory":
        return _checked(_user_feed(job, math.ceil(want / job.micro_batch), device_type, rank, world), job)
    collate = None
    if kind in ("synthetic_varlen", "hf") and job.seq_policy != "pack":
        collate = Collate(job.seq_policy, job.seq_len, bucket_lengths(job.seq_len, job.seq_buckets),
                          job.micro_batch if job.last_batch == "pad" else 0)
    elif job.last_batch == "pad":
        collate = Collate("longest", job.seq_len, [], job.micro_batch)
    if kind in ("synthetic", "synthetic_varlen"):
        ds = build_dataset(job, want, rank)
        return DataLoader(ds, batch_size=job.micro_batch, shuffle=False, drop_last=job.last_batch == "drop",
                          collate_fn=collate, **_loader_kw(job, device_type))
    ds = build_dataset(job, want, rank)  # a dataset's rows stay its own; packed rows and token windows: ``want``
    sampler = DistributedSampler(ds, world, rank, shuffle=False) if kind == "hf" and world > 1 else None
    loader = DataLoader(ds, batch_size=job.micro_batch, shuffle=False, sampler=sampler, collate_fn=collate,
                        drop_last=job.last_batch == "drop", **_loader_kw(job, device_type))
    return _checked(Feed(loader, math.ceil(want / job.micro_batch), job.data, sampler), job)


def _checked(feed: Feed, job: Job) -> Feed:
    """The feed with its batches' bounds: the reference GPT's ``seq_len`` (its positions) and :func:`job_vocab`;
    whether the model takes token ids (it has a token embedding) and whether other batches are accepted (the job
    names its ``loss``, or the model has no token embedding: core.engine.batches, "any other batch")."""
    seq = job.seq_len if job.uses_reference_model else 0  # a model of the user's has positions of its own
    feed.ids = takes_ids(job)
    try:
        feed.bounds = (seq, job_vocab(job) if feed.ids else 0)
    except Exception:  # noqa: BLE001 - a model the meta device cannot build: the training step
        feed.bounds = (seq, 0)  # still checks the first batch against the model it has
    feed.other = bool(job.loss) or not feed.ids
    return feed


def takes_ids(job: Job) -> bool:
    """Whether the job's model takes token ids: the reference GPT, or a model with a token embedding (built on the
    meta device). A model the meta device cannot build is taken to (its first batch says otherwise)."""
    if job.uses_reference_model or job.vocab_size:
        return True
    try:
        job_vocab(job)
    except StepError:  # no nn.Embedding: images, rows, signals
        return False
    except Exception:  # noqa: BLE001 - the meta device could not build it
        return True
    return True


def _user_feed(job: Job, n: int, device_type: str, rank: int, world: int) -> Feed:
    obj = user_data(job, rank, world)
    load_s = job.synthetic_load_ms / 1000.0
    what = f"{job.data}()"
    if isinstance(obj, DataLoader):
        return Feed(obj, n, what, getattr(obj, "sampler", None) if isinstance(getattr(obj, "sampler", None),
                    DistributedSampler) else None, load_s,
                    ("the data factory returns its own DataLoader: it is used as it is on every rank, so each rank "
                     "may see the same batches",), LOADER_KNOBS)
    if isinstance(obj, IterableDataset):
        return Feed(DataLoader(obj, batch_size=job.micro_batch, **_loader_kw(job, device_type)), n, what, None,
                    load_s, ("an IterableDataset is used as it is on every rank: each rank may see the same "
                             "batches",))
    if isinstance(obj, Dataset):
        sampler = DistributedSampler(obj, world, rank, shuffle=False) if world > 1 else None
        return Feed(DataLoader(obj, batch_size=job.micro_batch, sampler=sampler, drop_last=job.last_batch == "drop",
                               **_loader_kw(job, device_type)), n, what, sampler, load_s)
    if hasattr(obj, "__iter__"):
        return Feed(obj, n, what, None, load_s, ("the data factory returns an iterable of batches: it is used as it "
                                                 "is on every rank, so each rank may see the same batches",),
                    LOADER_KNOBS)
    raise StepError(f"job key 'data' = {job.data!r}: {job.data.split(':')[1]}() returned {type(obj).__name__}; "
                    "expected a torch Dataset, IterableDataset, DataLoader or an iterable of batches")
