"""The job's model sized without allocating it: built on the meta device (shapes only: no memory, no weights),
so a 7B float32 model (28 GB) is measured on a laptop. Feeds the memory formulas of
:mod:`mfu_lab.analysis.layouts.terms` (parameters, layers, hidden size, heads, vocabulary).

Heads and blocks are read as the layout checks read them (:func:`mfu_lab.core.engine.layout_check.read_shape`); the
hidden size and vocabulary from a Hugging Face config, else the model's attributes, else its input embedding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mfu_lab.core.engine.batches import input_embedding
from mfu_lab.core.engine.layout_check import read_shape
from mfu_lab.core.engine.workload import build_model
from mfu_lab.core.job.schema import Job

HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")  # Hugging Face configs, then module attributes
VOCAB_KEYS = ("vocab_size",)


@dataclass(frozen=True)
class MetaShape:
    """A model's size; a field not found is None, and ``source`` says where each found one was read."""

    params: int  # distinct parameters (a tied head counted once)
    param_bytes: int  # bytes per parameter as built (4: float32)
    n_layers: int | None
    d_model: int | None
    n_heads: int | None
    vocab_size: int | None
    source: dict[str, str] = field(default_factory=dict)

    @property
    def param_memory_bytes(self) -> int:
        return self.params * self.param_bytes


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def shape_of(model: nn.Module) -> MetaShape:
    """The size of a model on any device (the meta device included)."""
    params = list({id(p): p for p in model.parameters()}.values())
    n = sum(p.numel() for p in params)
    nbytes = max((p.element_size() for p in params), default=4)
    source = {"params": "model.parameters() (distinct)"}
    blocks = read_shape(model)
    heads = next(iter(blocks.heads.items()), None)
    if blocks.blocks:
        source["n_layers"] = blocks.blocks_where
    if heads:
        source["n_heads"] = heads[0]
    config = getattr(model, "config", None)
    emb, emb_where = input_embedding(model)
    d_model = vocab = None
    for key in HIDDEN_KEYS:
        for owner, where in ((config, "config"), (model, "model")):
            if d_model is None and _int(getattr(owner, key, None)):
                d_model, source["d_model"] = getattr(owner, key), f"{where}.{key}"
    if d_model is None and emb is not None:
        d_model, source["d_model"] = emb.embedding_dim, f"{emb_where}.embedding_dim"
    for key in VOCAB_KEYS:
        for owner, where in ((config, "config"), (model, "model")):
            if vocab is None and _int(getattr(owner, key, None)):
                vocab, source["vocab_size"] = getattr(owner, key), f"{where}.{key}"
    if vocab is None and emb is not None:
        vocab, source["vocab_size"] = emb.num_embeddings, f"{emb_where}.num_embeddings"
    return MetaShape(n, nbytes, blocks.blocks, d_model, heads[1] if heads else None, vocab, source)


def meta_model(job: Job) -> nn.Module:
    """The job's model (the reference GPT or the user's factory) built on the meta device."""
    with torch.device("meta"):
        return build_model(job)


def job_shape(job: Job) -> MetaShape:
    """The job's model size without allocating it. The reference GPT's layers, heads, width and vocabulary are its
    keys (read back from the model); a factory's are read from what it built."""
    return shape_of(meta_model(job))


def shaped(job: Job) -> Job:
    """The job with a factory model's ``n_layers``, ``d_model``, ``n_heads`` and (for 0) ``vocab_size`` read from
    the model built on the meta device; the file's values stay where the model does not tell (None in
    :class:`MetaShape`). The reference GPT's job is returned as it is: those keys build it."""
    if job.uses_reference_model:
        return job
    import dataclasses

    s = job_shape(job)
    read = {k: getattr(s, k) for k in ("n_layers", "d_model", "n_heads") if getattr(s, k)}
    if not job.vocab_size and s.vocab_size:
        read["vocab_size"] = s.vocab_size
    return dataclasses.replace(job, **read)
