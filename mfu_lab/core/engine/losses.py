"""The default loss, three ways (job key ``loss_impl``): eager, compiled, chunked.

- ``eager``: cross-entropy of the logits cast to float32, outside any compiled region (what most training
  scripts write: ``F.cross_entropy(logits.float().view(-1, V), y.view(-1))``). On a GPU the cast, the float32
  log-softmax forward and backward and the cast back are separate kernels: 22% of GPT-2 124M's step on an H200
  (``tests/data/h200``).
- ``compiled``: the same formula inside torch.compile. With ``compile_mode`` set, the forward and the loss are
  one compiled region (so reduce-overhead's CUDA graph covers the loss too); with ``compile_mode: off`` the loss
  alone is compiled (a fused log-softmax + NLL kernel, the model eager).
- ``chunked``: ``F.linear_cross_entropy`` (torch 2.13+) takes the hidden states and the head's weight and never
  writes the (tokens x vocab) logits. The model runs with its ``lm_head`` set aside for the call; the head's
  weight (tied or not) gets its gradient through the loss. It needs a model with an ``lm_head`` Linear, and it
  refuses a ``loss:`` factory and a compiled region (:mod:`mfu_lab.core.job.rules`): torch.compile falls back to
  eager at the chunked operator.

All three keep ``ignore_index`` = -100 (padding) and compute the same number: the choice is a speed and memory
lever, never a change of what is trained; step 4 races them and step 7 verifies the one adopted.
FLOP counting always traces the eager formula: the model's FLOPs are the same whichever runs.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from mfu_lab.core.errors import StepError

IGNORE_INDEX = -100


def cross_entropy(logits: torch.Tensor, y: torch.Tensor, vocab_size: int = 0) -> torch.Tensor:
    """Mean cross-entropy over the targets that are not ``-100``, the logits taken in float32."""
    if vocab_size and logits.size(-1) != vocab_size:
        raise StepError(f"the model's logits have {logits.size(-1)} classes; expected vocab_size={vocab_size}")
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX)


@functools.cache
def compiled_cross_entropy():
    """:func:`cross_entropy` under torch.compile (built once per process, on first use)."""
    return torch.compile(cross_entropy, dynamic=False)


def chunked_available() -> str | None:
    """Why this torch cannot run ``loss_impl: chunked``, or None."""
    if not hasattr(F, "linear_cross_entropy") or not hasattr(nn, "LinearCrossEntropyOptions"):
        return (f"key 'loss_impl' = 'chunked' needs torch.nn.functional.linear_cross_entropy (torch 2.13+); this "
                f"torch is {torch.__version__}: use eager or compiled")
    return None


def lm_head(model: nn.Module) -> nn.Linear | None:
    """The model's output head: an ``lm_head`` Linear (the reference GPT's, Hugging Face causal LMs'), or None."""
    head = getattr(model, "lm_head", None)
    return head if isinstance(head, nn.Linear) else None


def chunked_problem(model: nn.Module) -> str | None:
    """Why ``loss_impl: chunked`` cannot run on ``model`` here, or None."""
    why = chunked_available()
    if why:
        return why
    if lm_head(model) is None:
        return (f"key 'loss_impl' = 'chunked' needs the model's output head as an attribute lm_head (an nn.Linear), "
                f"which {type(model).__name__} does not have: use eager or compiled")
    return None


@contextlib.contextmanager
def head_set_aside(model: nn.Module) -> Iterator[nn.Linear]:
    """The model with ``lm_head`` replaced by an identity for the call: its forward returns the hidden states."""
    head = model.lm_head
    model.lm_head = nn.Identity()
    try:
        yield head
    finally:
        model.lm_head = head


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Linear, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of ``head(hidden)`` against ``y`` without the logits tensor (F.linear_cross_entropy's chunked
    path); the same value as :func:`cross_entropy` of the logits."""
    h = hidden.reshape(-1, hidden.size(-1))
    return F.linear_cross_entropy(h, head.weight, y.reshape(-1), linear_bias=head.bias,
                                  ignore_index=IGNORE_INDEX, options=nn.LinearCrossEntropyOptions())


def accumulation_weights(targets: list) -> list:
    """Each micro-batch's weight in an optimizer step of ``len(targets)`` micro-batches, so that the step's loss is
    the mean over all its useful tokens: a micro-batch's share of the targets that are not ``-100`` (tensors, no
    device synchronisation) when every target is a tensor of token ids, else 1 / k each. One micro-batch: [1]."""
    k = len(targets)
    if k == 1:
        return [1.0]
    if all(isinstance(y, torch.Tensor) and not (y.is_floating_point() or y.is_complex()) for y in targets):
        counts = [(y != IGNORE_INDEX).sum() for y in targets]
        total = torch.stack(counts).sum().clamp(min=1)
        return [c / total for c in counts]
    return [1.0 / k] * k
