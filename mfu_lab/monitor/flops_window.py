"""FLOPs of one training step, counted inside the user's own loop with the workbook's counter.

The window counted is one training iteration and nothing else:

- in a plain loop, the time between the first and the second ``Monitor.step()`` calls (whatever ran before the
  first ``step()``, such as an evaluation at iteration 0, is not counted);
- under a framework adapter, the time between the framework's batch-start and batch-end hooks of one optimizer
  step (all its micro-batches; the gaps between them, where the framework fetches data, evaluates or saves,
  are not counted).

A window in which an evaluation ran is not used, and the next one is counted instead: an evaluation is a forward
of the model while gradients are off (``torch.is_grad_enabled()`` false in a forward pre-hook on the model), or
one that a framework's own evaluation hooks report (:meth:`StepFlops.taint`). After ``MAX_WINDOWS`` such windows
the count is given up, and said so.

The counter is the workbook's (:func:`mfu_lab.core.measure.flops.count_flops`' FlopCounterMode with its attention
mapping), so a fused scaled-dot-product attention kernel counts its model FLOPs on every backend (torch's own
counter counts the CPU kernel as 0 and adds a recompute matmul for flash backward on GPU).

Threads: the counter is a dispatch mode on the stack of the thread that opened the window, and no thread can take
a mode off another's stack. A window that a ``step()`` on another thread closes is rejected (and the next one opens
on that thread); its mode is taken off its own thread's stack by that thread itself, at its next module call or
``step()`` (:func:`take_off_left`), and the counter's global module hooks go at once. After a fork, the child's
copy of an open window is taken off the child's thread (:meth:`StepFlops.drop_in_child`).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from torch.utils.flop_counter import FlopCounterMode

# the one attention mapping of the workbook: count_flops (step 1's count) uses the same table
from mfu_lab.core.measure.flops import _attention_mapping as attention_mapping

MAX_WINDOWS = 8  # windows tried before the count is given up (each had an evaluation in it)

_LEFT: dict[int, list] = {}  # thread id -> counting modes a window closed on another thread left on its stack
_LEFT_LOCK = threading.Lock()
_LEFT_HOOK: list = []  # the global module pre-hook that takes them off, while any is left


def _leave(mode: FlopCounterMode, owner: int) -> None:
    """A window closed on a thread other than ``owner``, the one it opened on: its module tracker's global hooks go
    now; its dispatch mode stays on ``owner``'s stack until that thread calls :func:`take_off_left`, which a global
    module pre-hook does at its next module call."""
    mode.mod_tracker.__exit__()
    with _LEFT_LOCK:
        _LEFT.setdefault(owner, []).append(mode.mode)
        if not _LEFT_HOOK:
            _LEFT_HOOK.append(register_module_forward_pre_hook(lambda module, args: take_off_left()))


def _pop_own(modes: list) -> list:
    """Pop each of ``modes`` that is on top of this thread's stack, newest first; those still under another mode
    are given back (a thread whose stack never held one, as a reused thread id, drops it)."""
    kept = []
    for m in reversed(modes):
        stack = _get_current_dispatch_mode_stack()
        if stack and stack[-1] is m:
            m.__exit__(None, None, None)
        elif any(x is m for x in stack):
            kept.insert(0, m)
    return kept


def _after_fork_in_child() -> None:
    """The child has one thread, the one that forked: its left modes are taken off, the others' stacks did not come
    along, and a lock another thread held at the fork is not waited for."""
    global _LEFT_LOCK
    _LEFT_LOCK = threading.Lock()
    _pop_own(_LEFT.pop(threading.get_ident(), []))
    _LEFT.clear()
    if _LEFT_HOOK:
        _LEFT_HOOK.pop().remove()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def take_off_left() -> None:
    """Take this thread's left counting modes off its stack (:func:`_leave`), forget those of threads that ended (a
    thread's stack ends with it), and remove the pre-hook when none is left. Costs a dict lookup when none is."""
    if not _LEFT:
        return
    me, alive = threading.get_ident(), {t.ident for t in threading.enumerate()}
    with _LEFT_LOCK:
        for ident in [i for i in _LEFT if i not in alive and i != me]:
            del _LEFT[ident]
        kept = _pop_own(_LEFT.pop(me, []))
        if kept:
            _LEFT[me] = kept
        if not _LEFT and _LEFT_HOOK:
            _LEFT_HOOK.pop().remove()


class StepFlops:
    """Counts FLOPs while resumed, sums over resume/pause pairs, and notices evaluations in the window."""

    def __init__(self, model: torch.nn.Module | None):
        self.model = model
        self.total = 0
        self.by_op: dict[str, int] = {}
        self.tainted = ""  # why the current window is not used ('' while it is clean)
        self.rejected: list[dict[str, Any]] = []
        self.opened = False  # a window is open (counting now, or paused between an adapter's batch hooks)
        self._mode: FlopCounterMode | None = None
        self._owner = 0  # the thread whose dispatch stack holds the mode
        self._hook = None

    @property
    def active(self) -> bool:
        return self._mode is not None

    def resume(self) -> None:
        """Count from here (a new window if the last one was finished or rejected)."""
        if self._mode is not None:
            return
        take_off_left()
        if self._hook is None and self.model is not None:
            self._hook = self.model.register_forward_pre_hook(self._pre_forward)
        mode = FlopCounterMode(display=False, custom_mapping=attention_mapping())
        mode.__enter__()
        self._mode, self._owner, self.opened = mode, threading.get_ident(), True

    def pause(self) -> None:
        """Stop counting; what was counted is kept (summed with the next resume's)."""
        mode, self._mode = self._mode, None
        if mode is None:
            return
        if threading.get_ident() != self._owner:  # its stack is another thread's: rejected, taken off there
            _leave(mode, self._owner)
            self.tainted = self.tainted or "step() ran on another thread than the one this window opened on"
            return
        mode.__exit__(None, None, None)
        self.total += int(mode.get_total_flops())
        for op, n in mode.get_flop_counts().get("Global", {}).items():
            self.by_op[str(op)] = self.by_op.get(str(op), 0) + int(n)

    def taint(self, why: str) -> None:
        """An evaluation (or anything that is not training) ran while this window was open."""
        if self.opened:
            self.tainted = self.tainted or why

    def reject(self, step: int) -> None:
        """Leave the window that ended at ``step`` out (it held an evaluation) and forget its count."""
        self.rejected.append({"step": step, "why": self.tainted, "flops": self.total})
        self.total, self.by_op, self.tainted, self.opened = 0, {}, "", False

    def close(self) -> None:
        self.pause()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def drop_in_child(self) -> None:
        """In a forked child: take the fork's copy of an open window off this (the only) thread's stack, with the
        counter's global module hooks and the model's hook; nothing is counted."""
        mode, self._mode = self._mode, None
        if mode is not None:
            mode.mod_tracker.__exit__()
            _pop_own([mode.mode])
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _pre_forward(self, module, args) -> None:
        if self._mode is not None and not torch.is_grad_enabled():
            self.tainted = self.tainted or "a forward of the model ran with gradients off (an evaluation)"


class CountsOneStep:
    """The Monitor's part that decides, at each ``step()``, whether the FLOP-count window opens, closes, is
    rejected (an evaluation ran in it) or is given up; it writes the ``flops`` record."""

    _flops: StepFlops | None
    framework: str
    steps_done: int
    flops_per_step: float | None
    flops_per_token: float | None
    flops_per_sample: float | None

    def _count(self, tokens: int | None, samples: int | None = None) -> bool:
        """Close (or open) the FLOP-count window at this step() call; True when this step was counted."""
        take_off_left()  # a window this thread opened and another closed
        f = self._flops
        if f is None:
            return False
        try:
            if not f.opened:
                if not self.framework and self.steps_done == 1:
                    f.resume()  # the window: from here to the next step() call
                return False  # (an adapter opened no window in this step)
            f.pause()
            if f.tainted:
                f.reject(self.steps_done)
                if len(f.rejected) >= MAX_WINDOWS:
                    self._give_up_count(None)
                elif not self.framework:
                    f.resume()  # the next iteration's window
                return True
            f.close()
            self._flops = None
            self._counted(f, tokens, samples)
            return True
        except Exception as e:
            self._give_up_count(e)
            return True

    def _counted(self, f: StepFlops, tokens: int | None, samples: int | None = None) -> None:
        window = ("between the framework's batch-start and batch-end hooks" if self.framework else
                  f"between step() calls {self.steps_done - 1} and {self.steps_done}")
        attention = sorted({op for op in f.by_op if "scaled_dot_product" in op or "attention" in op})
        common = {"step": self.steps_done, "window": window, "rejected_windows": f.rejected, "tokens": tokens,
                  "samples": samples}
        if f.total <= 0:
            self._emit("flops", source=None, **common, note="the FLOP counter counted nothing in a training step's "
                       "window (a compiled or custom-kernel model?): pass flops_per_token or flops_per_sample")
            return
        if tokens:
            self.flops_per_token = f.total / tokens
        if samples:
            self.flops_per_sample = f.total / samples
        self.flops_per_step = float(f.total)
        self._emit("flops", source="counted", per_step=float(f.total), per_token=self.flops_per_token,
                   per_sample=self.flops_per_sample, **common,
                   attention_ops=attention, counter="mfu_lab.core.measure.flops (FlopCounterMode, the "
                   "workbook's attention mapping)",
                   note=f"one training step as it ran (forward, backward, optimizer; recomputation, if "
                   f"any, included), counted {window}; that step is left out of the timing")

    def _give_up_count(self, error: BaseException | None) -> None:
        f, self._flops = self._flops, None
        if f is None:
            return
        try:
            f.close()
        except Exception:
            pass
        if error is not None:
            self._fail("flops", error)
        why = (f"an evaluation ran in each of {len(f.rejected)} windows" if error is None else
               f"the count failed ({type(error).__name__}: {error})")
        self._emit("flops", source=None, step=self.steps_done, rejected_windows=f.rejected,
                   note=f"no training step's FLOPs were counted: {why}; pass flops_per_token (or "
                   "flops_per_sample) for MFU")

