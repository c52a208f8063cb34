"""Batches as users have them, made into the one form every step trains on.

A step unpacks a batch as ``x, y = batch``: ``x`` the input token ids (batch, seq), ``y`` the targets aligned
with them, ``-100`` (:data:`IGNORE`) where a position has none. Users' data comes in three forms:

- a tensor of token ids (B, T): the targets are the ids shifted left by one, the last position has none;
- a pair ``(inputs, targets)``, targets already aligned (nanoGPT's ``get_batch``);
- a mapping with ``input_ids`` and optionally ``labels`` and ``attention_mask`` (Hugging Face). ``labels`` go
  into the model's ``forward`` unshifted (the model shifts them); the targets are ``labels`` shifted left, so the
  useful tokens are ``labels[:, 1:] != -100``. Without labels, the ids are the labels, masked by
  ``attention_mask`` where it is 0.

:class:`Batch` is that pair with the forward's keyword tensors (``labels``, ``attention_mask``) riding along in
``kwargs``; :func:`mfu_lab.core.measure.timed.run_steps` passes them on, a loop that does not trains on the pair.

**Any other batch** (images and labels, regression pairs, a dict of tensors) trains when the job names its own
``loss:`` (or the model has no token embedding and returns ``.loss``): it is kept as it is, on the device, with
``Batch.tokens`` False. ``x`` is then what goes into the model (the first of a tuple, or the dict, or the tensor) and
``y`` the rest (the second of a pair, a :class:`Rest` of the others, or None); the loss gets the batch as the data
gave it (:func:`loss_view`). Such a batch has samples (its first dimension), no tokens: nothing in it scales the
FLOPs, and ``-100`` in it is the user's business.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from mfu_lab.core.errors import StepError

IGNORE = -100  # a target position cross_entropy skips: padding (core.engine.workload pads targets with it)

FORWARD_KEYS = ("labels", "attention_mask")


README_SECTION = "README, 'Your own model and data'"


class Batch(tuple):
    """``(x, y)`` with ``kwargs``: the model's extra keyword tensors (``labels``, ``attention_mask``). ``tokens``:
    False for a batch that is not token ids (module docstring), whose ``x`` and ``y`` are as the data gave them."""

    kwargs: dict[str, torch.Tensor]
    tokens: bool

    def __new__(cls, x: Any, y: Any, kwargs: dict[str, torch.Tensor] | None = None, tokens: bool = True):
        b = super().__new__(cls, (x, y))
        b.kwargs = dict(kwargs or {})
        b.tokens = tokens
        return b

    def __reduce__(self):  # DataLoader workers send batches through pickle; keep the keyword tensors
        return (Batch, (self[0], self[1], self.kwargs, self.tokens))


class Rest(tuple):
    """The targets of a batch tuple of three or more: everything after the model's input."""


def to_device(obj: Any, device: Any, non_blocking: bool = False) -> Any:
    """``obj`` with every tensor in it (a tensor, tuple, list or dict, nested) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if obj is None:
        return None
    moved = pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=non_blocking), obj)
    return Rest(moved) if isinstance(obj, Rest) else moved


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in ``obj``, in order (a tensor, tuple, list or dict, nested)."""
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def samples_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (1 for a scalar, 0 for none)."""
    ts = tensors(batch[0] if isinstance(batch, Batch) else batch)
    if not ts:
        return 0
    return int(ts[0].shape[0]) if ts[0].dim() else 1


def shape_key(obj: Any) -> str:
    """Every tensor's shape and dtype in ``obj``, with the structure around them (a FLOP count's cache key)."""
    if isinstance(obj, torch.Tensor):
        return f"{tuple(obj.shape)}:{obj.dtype}"
    leaves, spec = pytree.tree_flatten(obj)
    return repr((str(spec), [f"{tuple(t.shape)}:{t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
                             for t in leaves]))


def describe(obj: Any) -> str:
    """What a batch is, for an error: its type and every tensor's shape and dtype."""
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)} and dtype {obj.dtype}"
    if isinstance(obj, Mapping):
        return "a dict {" + ", ".join(f"{k!r}: {describe(v)}" for k, v in obj.items()) + "}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)} (" + "; ".join(describe(v) for v in obj) + ")"
    return f"a {type(obj).__name__}"


def not_tokens_hint(raw: Any) -> str:
    """What a batch that is not token ids needs: the key to set, what it got, where the README says more."""
    return (f"; the batch is {describe(raw)}. A batch that is not token ids trains with the job's own loss: set "
            "key 'loss' to package.module:function taking (output, batch), which receives the batch as your data "
            f"gives it ({README_SECTION})")


@lru_cache(maxsize=64)
def _forward_params(cls: type) -> tuple[frozenset[str], bool]:
    try:
        params = inspect.signature(cls.forward).parameters
    except (TypeError, ValueError, AttributeError):
        return frozenset(), False
    return (frozenset(params) - {"self"},
            any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()))


def forward_params(model: Any) -> tuple[frozenset[str], bool]:
    """The names the model's ``forward`` takes and whether it takes any keyword (``**kwargs``), read once per class
    (a training loop asks at every step)."""
    return _forward_params(type(model))


def call_model(fn: Any, x: Any, model: Any = None) -> Any:
    """``fn`` (the model, or a wrapper of ``model``: compiled, DDP, an explainer) on one input: a dict of tensors as
    the keywords the model's forward takes, anything else as its one positional input. A dict none of whose keys
    the forward takes names them and the README section."""
    if not isinstance(x, Mapping):
        return fn(x)
    params, anything = forward_params(fn if model is None else model)
    kw = {k: v for k, v in x.items() if anything or k in params}
    if not kw:
        raise StepError(f"the batch is {describe(x)}, but the model's forward takes none of its keys (it takes "
                        f"{sorted(params)}): give the model's input as the dict's key, or the batch as a pair "
                        f"(inputs, targets) ({README_SECTION})")
    return fn(**kw)


def any_batch(raw: Any) -> Batch:
    """A batch that is not token ids, kept as the data gave it (module docstring)."""
    if isinstance(raw, (tuple, list)) and not isinstance(raw, Rest):
        if not raw:
            raise StepError("a batch is an empty " + type(raw).__name__ + "; expected at least the model's input")
        if len(raw) == 1:
            return Batch(raw[0], None, tokens=False)
        return Batch(raw[0], raw[1] if len(raw) == 2 else Rest(raw[1:]), tokens=False)
    if not tensors(raw):
        raise StepError(f"a batch is {describe(raw)} and holds no tensor; expected tensors (a tensor, a tuple or a "
                        f"dict of them) ({README_SECTION})")
    return Batch(raw, None, tokens=False)


def shift_left(labels: torch.Tensor) -> torch.Tensor:
    """Targets aligned with the inputs from labels the model shifts itself: ``y[:, t] = labels[:, t + 1]``, the
    last position none."""
    y = torch.full_like(labels, IGNORE)
    y[:, :-1] = labels[:, 1:]
    return y


def _ids(t: Any, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise StepError(f"a batch's {what} is a {type(t).__name__}; expected a tensor of token ids (batch, seq)")
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise StepError(f"a batch's {what} has dtype {t.dtype}; token ids are integers (torch.long)")
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2:
        raise StepError(f"a batch's {what} has shape {tuple(t.shape)}; expected (batch, seq)")
    return t.long()


def as_batch(raw: Any, ids: bool = True, other: bool = False) -> Batch:
    """One batch as the user's data gives it, as a :class:`Batch` (module docstring). ``ids``: the model takes
    token ids (it has a token embedding), so the three token forms are tried first; ``other``: any other batch is
    accepted as it is (the job names its ``loss:``, or the model has no token embedding). A batch that fits
    neither names the key to set."""
    if isinstance(raw, Batch):
        return raw
    if not ids:
        return any_batch(raw)
    try:
        return token_batch(raw)
    except StepError as e:
        if other:
            return any_batch(raw)
        raise StepError(str(e) + not_tokens_hint(raw)) from None


def token_batch(raw: Any) -> Batch:
    """One of the three token forms as a :class:`Batch`; a StepError for anything else."""
    if isinstance(raw, torch.Tensor):
        x = _ids(raw, "token ids")
        return Batch(x, shift_left(x))
    if isinstance(raw, Mapping):
        if "input_ids" not in raw:
            raise StepError(f"a batch is a mapping with keys {sorted(map(str, raw))}; it needs 'input_ids' (and "
                            "optionally 'labels' and 'attention_mask', the Hugging Face convention)")
        x = _ids(raw["input_ids"], "'input_ids'")
        mask = raw.get("attention_mask")
        labels = raw.get("labels")
        if labels is None:
            labels = x.masked_fill(mask.to(x.device) == 0, IGNORE) if mask is not None else x.clone()
        else:
            labels = _ids(labels, "'labels'")
        if labels.shape != x.shape:
            raise StepError(f"a batch's 'labels' have shape {tuple(labels.shape)}, its 'input_ids' "
                            f"{tuple(x.shape)}; they must match (the model shifts the labels itself)")
        kw = {"labels": labels}
        if mask is not None:
            kw["attention_mask"] = mask
        return Batch(x, shift_left(labels), kw)
    if isinstance(raw, (tuple, list)) and len(raw) == 2:
        x, y = _ids(raw[0], "inputs (first of the pair)"), _ids(raw[1], "targets (second of the pair)")
        if x.shape != y.shape:
            raise StepError(f"a batch pair's inputs have shape {tuple(x.shape)} and its targets "
                            f"{tuple(y.shape)}; they must match (targets aligned with inputs, -100 for none)")
        return Batch(x, y)
    raise StepError(f"a batch is a {type(raw).__name__}; expected a tensor of token ids (batch, seq), a pair "
                    "(inputs, targets) or a mapping with 'input_ids' (and optionally 'labels', 'attention_mask')")


def batch_problem(batch: Batch, index: int, what: str, seq_len: int = 0, vocab: int = 0) -> str | None:
    """Why batch ``index`` (from 1) of the data ``what`` cannot be trained on, naming the key to change; None when it
    can. Checked: not empty, rows no longer than ``seq_len``, token ids in 0..``vocab`` - 1 and targets too (or
    :data:`IGNORE`); 0 leaves a bound out. Read on the host with numpy, before the batch is moved: no torch operator
    (a profiled step's trace holds the job's own) and no device synchronisation. A batch the data gives on a device
    already is not read (that would wait for the device); the training step checks the first one."""
    x, y = batch[0], batch[1]
    if not getattr(batch, "tokens", True):  # not token ids: its values are the user's loss's business
        if not any(t.numel() for t in tensors(x)):
            return f"batch {index} of the data ({what}) is empty ({describe(x)}); check key 'data'"
        return None
    if x.device.type != "cpu" or y.device.type != "cpu":
        return None
    at = f"batch {index} of the data ({what})"
    if x.numel() == 0:
        return f"{at} is empty (shape {tuple(x.shape)}): every batch needs at least one token; check key 'data'"
    if seq_len and x.size(1) > seq_len:
        return (f"{at} has rows of {x.size(1)} tokens, longer than seq_len ({seq_len}, the model's positions): set "
                f"key 'seq_len' to at least {x.size(1)}, or cut the data's rows to {seq_len} tokens")
    ids, targets = x.numpy(), y.numpy()
    fix = ("the data and the model disagree: set key 'vocab_size' to the model's vocabulary (0: its input "
           "embedding's), or check the data, data_dtype and the tokenizer")
    low, top = int(ids.min()), int(ids.max())
    if low < 0:
        return f"{at} holds token id {low}: token ids are 0 or more; check key 'data' and data_dtype"
    if vocab and top >= vocab:
        return f"{at} holds token id {top}, past the vocabulary's {vocab} ids (0..{vocab - 1}): {fix}"
    if targets.size:
        low, top = int(targets.min()), int(targets.max())
        if vocab and top >= vocab:
            return f"{at} holds target {top}, past the vocabulary's {vocab} ids (0..{vocab - 1}): {fix}"
        if low < 0 and (low != IGNORE or bool(((targets < 0) & (targets != IGNORE)).any())):
            bad = int(targets[(targets < 0) & (targets != IGNORE)][0])
            return (f"{at} holds target {bad}: a target is a token id (0 or more) or {IGNORE} for none; check key "
                    "'data' (its labels)")
    return None


def checked_batch(raw: Any, index: int, what: str, seq_len: int = 0, vocab: int = 0, ids: bool = True,
                  other: bool = False) -> Batch:
    """:func:`as_batch`, then :func:`batch_problem`'s check: a StepError naming the batch and the key."""
    batch = as_batch(raw, ids, other)
    why = batch_problem(batch, index, what, seq_len, vocab)
    if why:
        raise StepError(why)
    return batch


def loss_problem(loss: Any, fn: Any) -> str | None:
    """Why what the job's own loss function ``fn`` returned cannot be trained on, naming the key; None when it is
    one number (a floating-point tensor of one element). Reads no value: no device synchronisation."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return None
    spec = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', '?')}"
    got = (f"a tensor of shape {tuple(loss.shape)} and dtype {loss.dtype}" if isinstance(loss, torch.Tensor)
           else type(loss).__name__)
    return (f"key 'loss' = {spec!r} returned {got}; a loss is one number to train on: a floating-point tensor of "
            "one element (the mean of a per-token loss, say)")


def loss_view(x: Any, y: Any, kwargs: dict[str, torch.Tensor]) -> Any:
    """The batch as a user's loss function of ``(output, batch)`` receives it: the mapping for Hugging Face style
    batches (``input_ids``, ``labels``, ``attention_mask``), else the pair ``(inputs, targets)``; a batch that is not
    token ids as the data gave it (a dict, a lone tensor, a tuple of three or more)."""
    if kwargs:
        return {"input_ids": x, **kwargs}
    if isinstance(x, Mapping) or y is None:
        return x
    if isinstance(y, Rest):
        return (x, *y)
    return (x, y)


# ------------------------------------------------------------------ the vocabulary
def input_embedding(model: nn.Module) -> tuple[nn.Embedding | None, str]:
    """The model's token embedding and where it was found: ``get_input_embeddings()`` (Hugging Face), else the
    largest ``nn.Embedding`` (the token table, not positions)."""
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            emb = get()
            if isinstance(emb, nn.Embedding):
                return emb, "get_input_embeddings()"
        except (NotImplementedError, AttributeError):
            pass
    embs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)]
    if not embs:
        return None, ""
    name, emb = max(embs, key=lambda nm: nm[1].num_embeddings)
    return emb, name


def vocab_problem(model: nn.Module, x: torch.Tensor, job_vocab: int, data: str, reference: bool) -> str | None:
    """Why the token ids of ``x`` cannot go into the model's input embedding, naming both sizes and the key to
    change; None when they fit (or the model has no embedding to check against)."""
    emb, where = input_embedding(model)
    if (emb is None or not isinstance(x, torch.Tensor) or x.is_floating_point() or x.is_complex() or x.numel() == 0
            or x.device.type == "meta"):
        return None
    try:
        top, rows = int(x.max()), emb.num_embeddings
    except (RuntimeError, TypeError, NotImplementedError):  # a fake or traced tensor has no value to read
        return None
    if top < rows:
        return None
    if data.startswith(("synthetic",)):
        fix = (f"the synthetic tokens go up to vocab_size ({job_vocab}): set vocab_size to {rows} (or 0, which "
               "takes the model's size)" if not reference else f"set vocab_size to at most {rows}")
    else:
        fix = (f"the data ({data}) and the model disagree: give the model a vocabulary of at least {top + 1} "
               "(model_kwargs" + (", vocab_size" if reference else "") + "), or check data_dtype and the tokenizer")
    return (f"the batch holds token id {top}, but the model's input embedding ({where}) has {rows} rows "
            f"(ids 0..{rows - 1}): {fix}")
