"""The pipeline's clock in a layout rank (mfu_lab.workers.layout_rank): each stage's fill and drain per timed
step, for the bubble that steps 1 and 6 measure; and a test fault that slows a stage's last backward."""

from __future__ import annotations

import itertools
import statistics
import time

import torch
import torch.distributed as dist

from mfu_lab.core.engine.parallelize import Parallelized
from mfu_lab.core.engine.tp_plan import blocks_of


class StageClock:
    """Under PP: each stage's first forward and last backward in every ``schedule.step``, relative to that call's
    start and to the instant every pipeline rank has left it (a one-element all-reduce over the "pp" group after
    the call; the optimizer step is outside). That common end puts the last rank's drain, its wait for the
    first stage's last backward, into the step: its own call returns as soon as its last gradient is sent.
    Forward: a pre-hook on the stage module; backward: a full backward hook on its first block (the stage's
    last backward work, the embedding's aside). On a GPU the instants are CUDA events, read after the steps
    (:meth:`rows`), and the all-reduce is ordered on the stream, with no host synchronisation; on a CPU,
    perf_counter."""

    def __init__(self, par: Parallelized, cuda: bool):
        self.cuda, self.steps, self.handles = cuda, [], []
        self.indices = par.stage_indices
        for i, m in zip(par.stage_indices, par.modules):
            self.handles.append(m.register_forward_pre_hook(lambda mod, args, i=i: self._mark("f", i)))
            first = (blocks_of(m) or [m])[0]
            self.handles.append(first.register_full_backward_hook(lambda mod, gi, go, i=i: self._mark("b", i)))
        self.schedule, self.orig = par.schedule, par.schedule.step
        group = par.mesh["pp"].get_group()
        flag = torch.zeros(1, device=next(par.modules[0].parameters()).device)

        def step(*args, **kw):
            self.cur = {"start": self._now(), "f": {}, "b": {}}
            out = self.orig(*args, **kw)
            dist.all_reduce(flag, group=group)  # returns (CPU) or completes (GPU) once every pp rank is here
            self.cur["end"] = self._now()
            self.steps.append(self.cur)
            return out

        par.schedule.step = step

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)  # pragma: no cover - GPU only
        e.record()  # pragma: no cover - GPU only
        return e  # pragma: no cover - GPU only

    def _mark(self, kind: str, i: int) -> None:
        if kind == "f" and i in self.cur["f"]:
            return  # the first forward only; every backward overwrites: the last one stays
        self.cur[kind][i] = self._now()

    def _dt(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def rows(self, skip: int = 0) -> list[dict]:
        """Median fill, drain and step seconds per stage over the steps after the first ``skip``."""
        if self.cuda:  # pragma: no cover - GPU only
            torch.cuda.synchronize()  # sync point: every event recorded in the steps has completed
        out = []
        for i in self.indices:
            per = [(self._dt(s["start"], s["f"][i]), self._dt(s["b"][i], s["end"]), self._dt(s["start"], s["end"]))
                   for s in self.steps[skip:] if i in s["f"] and i in s["b"]]
            if per:
                fill, drain, step = (statistics.median(v) for v in zip(*per))
                out.append({"stage": i, "fill_s": fill, "drain_s": drain, "step_s": step,
                            "fraction": (fill + drain) / step if step else 0.0, "steps": len(per)})
        for h in self.handles:
            h.remove()
        self.schedule.step = self.orig
        return out


def slow_last_backward(module, seconds: float, micro_batches: int) -> None:
    """Tests only: the backward of ``module``'s first block (where the stage's backward ends, as :class:`StageClock`
    reads it) sleeps ``seconds`` on every ``micro_batches``-th call."""
    calls = itertools.count(1)
    first = (blocks_of(module) or [module])[0]
    first.register_full_backward_hook(lambda *_: time.sleep(seconds) if next(calls) % micro_batches == 0 else None)
