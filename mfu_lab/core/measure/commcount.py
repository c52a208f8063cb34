"""Count every collective and point-to-point op a rank issues, with its bytes: ``CommDebugMode`` with bytes.

    with CollectiveCounter() as c:
        loss = model(x).sum(); loss.backward(); opt.step()
    c.summary()  # {"allgather": {"count": 4, "bytes": 8192}, "reduce_scatter": {...}, ...}

What passes through PyTorch's dispatcher, and so through this ``TorchDispatchMode`` (checked on torch 2.13 with
gloo at world 2, tests/test_commcount.py):

- the functional collectives (``_c10d_functional.*``) that DTensor issues for tensor and sequence parallel:
  those of explicit redistributions (the TP plan's module hooks) directly, and those a DTensor op needs
  inside its own dispatch (SP's partial LayerNorm gradients all-reduced in ``opt.step()``) because the mode
  returns ``NotImplemented`` for DTensor arguments, letting DTensor desugar first, as CommDebugMode does.
  Without that, a mode sees ``aten.lerp_`` on DTensors and none of the all-reduces inside it;
- the c10d ops behind ``torch.distributed``'s eager API, which FSDP2, DDP and pipelining call:
  FSDP2's all-gather (``dist.all_gather_single`` -> ``c10d._allgather_base_``) and reduce-scatter
  (``dist.reduce_scatter_single`` -> ``c10d._reduce_scatter_base_``), ``all_reduce`` (``c10d.allreduce_``),
  ``broadcast_``, and the pipeline's ``isend``/``irecv`` and ``batch_isend_irecv`` (``c10d.send``,
  ``c10d.recv_``). No path we use bypasses dispatch, so no ProcessGroup is wrapped.
- DDP's Reducer all-reduces its gradient buckets through ``c10d.allreduce_`` too (seen in backward, one
  record per bucket); its start-up broadcast of the module state happens at construction, outside the step.

Autograd's worker threads (CUDA backward) inherit the dispatch-mode stack with the rest of the thread-local
state, so collectives issued in backward on a GPU are seen as on a CPU (untested here: no GPU).

Byte convention (one number per collective, the volume of the whole buffer, as nccl-tests' "size"):

- allgather: the gathered OUTPUT, i.e. the per-rank input shard x the group size (FSDP2's all-gather of a
  block's parameters counts the block's full parameter bytes, not the shard);
- reduce_scatter: the INPUT, the whole tensor before it is scattered (FSDP2's gradient bytes);
- allreduce, broadcast, alltoall: the tensor (alltoall: this rank's input); an all-reduce taking a max is
  counted apart, as ``allreduce_max`` (``MAX_KIND``);
- send / recv: the tensor sent / received by this rank.

With this convention TP's all-reduce of b*s*h bytes becomes, under SP, an all-gather plus a reduce-scatter of
the same b*s*h bytes, and FSDP2's per-step figures are multiples of the parameter and gradient bytes
(:mod:`mfu_lab.analysis.layouts.terms`). A rank's own share of the traffic is ``bytes / group_size`` for
allgather and reduce_scatter; each record keeps ``group_size``. Coalesced calls count once, with the bytes of
all their tensors. gloo has no native reduce-scatter (it runs an all-reduce of the whole input): the op is
still counted as reduce_scatter, since it is what the program asked for and what NCCL does on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

KINDS = ("allgather", "reduce_scatter", "allreduce", "allreduce_max", "broadcast", "send", "recv", "alltoall",
         "gather", "scatter", "reduce")
# an all-reduce that takes a max, kept apart from the sums it would otherwise be counted with: torchao's FP8 scales
# under tensor parallel, the amax of each sharded weight, input or gradient (a float64 scalar each for the tensorwise
# recipe: 36 of a tp-2 step's 44 all-reduces in the 2-layer test GPT; a row of amaxes for rowwise), or a norm's max.
# The layouts' closed forms are sums.
MAX_KIND = "allreduce_max"


def _nbytes(t) -> int:
    """Bytes of a tensor, or of a (nested) list of tensors. A tensor subclass that carries its payload in ``_data``
    (torchao's Float8TrainingTensor: a bf16 wrapper around float8 bytes, which its collectives move) counts that."""
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    if type(t) is not torch.Tensor and isinstance(getattr(t, "_data", None), torch.Tensor):
        t = t._data
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _op_name(op) -> str:
    """A reduce op's name, lower case: a functional collective's string ("max"), or c10d's ReduceOp object."""
    if isinstance(op, str):
        return op.lower()
    try:
        code = op.op() if isinstance(op, torch.ScriptObject) else getattr(op, "op", op)  # or a RedOpType itself
        from torch.distributed import ReduceOp
        return next(k for k, v in ReduceOp.RedOpType.__members__.items() if int(v) == int(code)).lower()
    except Exception:  # no distributed build, or not a reduce op
        return ""


def _pg(pg):
    """The ProcessGroup behind a c10d op's argument (a TorchScript object at the dispatcher), or None."""
    try:
        from torch.distributed import ProcessGroup
        return ProcessGroup.unbox(pg) if isinstance(pg, torch.ScriptObject) else pg
    except Exception:  # no distributed build, or an object that is not a process group
        return None


def _pg_size(pg) -> int:
    try:
        return int(_pg(pg).size())
    except Exception:  # unknown
        return 0


def _named_size(name) -> int:
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group
        return int(_resolve_process_group(name).size())
    except Exception:
        return 0


def _pg_name(pg) -> str:
    try:
        return str(_pg(pg).group_name)
    except Exception:
        return ""


# op name -> (kind, bytes(args), group size(args), group name(args)); every schema is in the op's docstring:
# print(torch.ops.c10d._allgather_base_.default._schema)
_Rule = tuple[str, Callable, Callable, Callable]
_C10D: dict[str, _Rule] = {
    "_allgather_base_": ("allgather", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[2]), lambda a: _pg_name(a[2])),
    "allgather_": ("allgather", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[2]), lambda a: _pg_name(a[2])),
    "allgather_coalesced_": ("allgather", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[2]),
                             lambda a: _pg_name(a[2])),
    "allgather_into_tensor_coalesced_": ("allgather", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[2]),
                                         lambda a: _pg_name(a[2])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1]), lambda a: _pg_size(a[2]),
                              lambda a: _pg_name(a[2])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1]), lambda a: _pg_size(a[2]),
                        lambda a: _pg_name(a[2])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1]), lambda a: _pg_size(a[2]),
                                         lambda a: _pg_name(a[2])),
    "allreduce_": ("allreduce", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[1]), lambda a: _pg_name(a[1])),
    "allreduce_coalesced_": ("allreduce", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[1]),
                             lambda a: _pg_name(a[1])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[1]), lambda a: _pg_name(a[1])),
    "alltoall_": ("alltoall", lambda a: _nbytes(a[1]), lambda a: _pg_size(a[2]), lambda a: _pg_name(a[2])),
    "alltoall_base_": ("alltoall", lambda a: _nbytes(a[1]), lambda a: _pg_size(a[2]), lambda a: _pg_name(a[2])),
    "send": ("send", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[1]), lambda a: _pg_name(a[1])),
    "recv_": ("recv", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[1]), lambda a: _pg_name(a[1])),
    "recv_any_source_": ("recv", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[1]), lambda a: _pg_name(a[1])),
    "gather_": ("gather", lambda a: _nbytes(a[1]), lambda a: _pg_size(a[2]), lambda a: _pg_name(a[2])),
    "scatter_": ("scatter", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[2]), lambda a: _pg_name(a[2])),
    "reduce_": ("reduce", lambda a: _nbytes(a[0]), lambda a: _pg_size(a[1]), lambda a: _pg_name(a[1])),
}
_FUNCOL: dict[str, _Rule] = {  # functional collectives: (input, ..., group_size?, group_name)
    "all_gather_into_tensor": ("allgather", lambda a: _nbytes(a[0]) * a[1], lambda a: a[1], lambda a: str(a[2])),
    "all_gather_into_tensor_out": ("allgather", lambda a: _nbytes(a[0]) * a[1], lambda a: a[1],
                                   lambda a: str(a[2])),
    "all_gather_into_tensor_coalesced": ("allgather", lambda a: _nbytes(a[0]) * a[1], lambda a: a[1],
                                         lambda a: str(a[2])),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0]), lambda a: a[2], lambda a: str(a[3])),
    "reduce_scatter_tensor_out": ("reduce_scatter", lambda a: _nbytes(a[0]), lambda a: a[2], lambda a: str(a[3])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[0]), lambda a: a[2],
                                        lambda a: str(a[3])),
    "all_reduce": ("allreduce", lambda a: _nbytes(a[0]), lambda a: _named_size(a[2]), lambda a: str(a[2])),
    "all_reduce_": ("allreduce", lambda a: _nbytes(a[0]), lambda a: _named_size(a[2]), lambda a: str(a[2])),
    "all_reduce_coalesced": ("allreduce", lambda a: _nbytes(a[0]), lambda a: _named_size(a[2]),
                             lambda a: str(a[2])),
    "all_reduce_coalesced_": ("allreduce", lambda a: _nbytes(a[0]), lambda a: _named_size(a[2]),
                              lambda a: str(a[2])),
    "all_to_all_single": ("alltoall", lambda a: _nbytes(a[0]), lambda a: _named_size(a[3]), lambda a: str(a[3])),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0]), lambda a: _named_size(a[2]), lambda a: str(a[2])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0]), lambda a: _named_size(a[2]), lambda a: str(a[2])),
    "isend": ("send", lambda a: _nbytes(a[0]), lambda a: _named_size(a[3]), lambda a: str(a[3])),
    "irecv": ("recv", lambda a: _nbytes(a[0]), lambda a: _named_size(a[3]), lambda a: str(a[3])),
}
_NAMESPACES = {"c10d": _C10D, "_c10d_functional": _FUNCOL}


@dataclass(frozen=True)
class Collective:
    """One collective or p2p call: its kind, the op that issued it, its bytes (module docstring), its group."""

    kind: str
    op: str
    bytes: int
    group_size: int
    group: str
    reduce_op: str = ""  # an all-reduce's: "sum", "max", ... ("" where the op takes none)


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives and p2p ops issued inside it, by kind, with bytes (the module's convention).

    ``records`` keeps every call in order; ``summary(group=...)`` restricts to one process group by name
    (e.g. a 2-D mesh's ``mesh.get_group("tp").group_name``).
    """

    def __init__(self):
        super().__init__()
        self.records: list[Collective] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # modes run before subclasses, so let DTensor desugar into local ops and the
            # collectives it needs (e.g. an optimizer's Partial gradient all-reduced inside aten.lerp_), which
            # then come back through this mode (CommDebugMode does the same)
            return NotImplemented
        kwargs = kwargs or {}
        rules = _NAMESPACES.get(func.namespace)
        if rules is not None:
            name = func._schema.name.split("::")[1]
            if name == "batch_p2p_ops":  # (op_list, peer_list, tag_list, tensors, group_name)
                for op, t in zip(args[0], args[3]):
                    kind = "send" if "send" in op else "recv"
                    self.records.append(Collective(kind, str(func), _nbytes(t), _named_size(args[4]), str(args[4])))
            elif name in rules:
                kind, nbytes, size, group = rules[name]
                a = _with_kwargs(func, args, kwargs)
                op = _op_name(a[1] if func.namespace == "_c10d_functional" else a[2]) if kind == "allreduce" else ""
                self.records.append(Collective(MAX_KIND if op == "max" else kind, str(func), nbytes(a),
                                               size(a), group(a), op))
        return func(*args, **kwargs)

    def summary(self, group: str | None = None) -> dict[str, dict[str, int]]:
        """{kind: {"count": calls, "bytes": bytes}} over the kinds seen (optionally in one process group)."""
        out: dict[str, dict[str, int]] = {}
        for r in self.records:
            if group is None or r.group == group:
                row = out.setdefault(r.kind, {"count": 0, "bytes": 0})
                row["count"] += 1
                row["bytes"] += r.bytes
        return {k: out[k] for k in KINDS if k in out}

    def reset(self) -> None:
        self.records.clear()


def _with_kwargs(func, args, kwargs) -> list:
    """The op's arguments by position, keyword ones (``out=``, defaults given by name) appended in schema order."""
    if not kwargs:
        return list(args)
    a = list(args)
    for arg in func._schema.arguments[len(args):]:
        if arg.name in kwargs:
            a.append(kwargs[arg.name])
    return a

