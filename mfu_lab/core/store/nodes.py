"""Results of a step run on several nodes at once (``nnodes`` > 1, e.g. one notebook per node under ``srun``).

Every node writes its own ``<NN_step>/nodes/node<k>.json``; node 0 (rank 0 of node 0) owns the step's
``result.json``, which keeps node 0's figures and adds ``nodes``: each node's host, and per metric the value on
every node, the spread (max / min - 1) and, for times, the slowest node. Nodes that have not written their file
when node 0 saves are named as missing; ``mfu-lab report`` merges them again later (:func:`merge_into`).

A node finds its rank in the launcher's environment: ``MFU_LAB_NODE_RANK``, then Slurm's ``SLURM_NODEID``, then
torchrun's ``NODE_RANK`` / ``GROUP_RANK``. With none set on a multi-node job, node 0 cannot be told apart: the
node says so in its file and is taken as node 0.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.core.store.files import DamagedFile, read_json

NODE_ENV = ("MFU_LAB_NODE_RANK", "SLURM_NODEID", "NODE_RANK", "GROUP_RANK")
NODES_DIR = "nodes"
WAIT_S = 60.0  # node 0 waits this long for the other nodes' files before it writes the step's result


@dataclass(frozen=True)
class Node:
    rank: int
    count: int
    host: str
    how: str  # where the rank came from, or why it is a guess

    @property
    def owns_result(self) -> bool:
        return self.rank == 0

    def file(self, step_dir: Path) -> Path:
        return Path(step_dir) / NODES_DIR / f"node{self.rank}.json"


def launcher_folder(base: Path) -> Path:
    """``base/<host>-<pid>``: the work folder of this node's launcher. Every node of a multi-node step runs its own
    launcher, and on a shared file system they must not share a ``progress.jsonl`` (each removes it at start, and
    each watchdog would read the other's events) nor heartbeats or logs."""
    return Path(base) / f"{platform.node() or 'node'}-{os.getpid()}"


def this_node(nnodes: int, env: dict[str, str] | None = None) -> Node:
    """This process's node in a launch of ``nnodes`` nodes, from the launcher's environment."""
    env = os.environ if env is None else env
    host = socket.gethostname()
    for name in NODE_ENV:
        value = env.get(name, "")
        if value.strip().isdigit():
            return Node(int(value), nnodes, host, f"{name}={value}")
    return Node(0, nnodes, host, f"no node rank in the environment ({', '.join(NODE_ENV)} unset): taken as node 0, "
                                 "so every node writes result.json; set one of them per node")


def node_files(step_dir: Path) -> dict[int, dict[str, Any]]:
    """Every node's stored result in ``step_dir/nodes``, by node rank (damaged files left out)."""
    out = {}
    for p in sorted((Path(step_dir) / NODES_DIR).glob("node*.json")):
        suffix = p.stem[4:]
        if suffix.isdigit():
            try:
                out[int(suffix)] = read_json(p)
            except DamagedFile:
                continue
    return out


def wait_for(step_dir: Path, count: int, timeout_s: float = WAIT_S, poll_s: float = 1.0) -> dict[int, dict]:
    """The nodes' files once all ``count`` are there, or what is there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    found = node_files(step_dir)
    while len(found) < count and time.monotonic() < deadline:
        time.sleep(poll_s)
        found = node_files(step_dir)
    return found


def summary(found: dict[int, dict[str, Any]], count: int) -> dict[str, Any]:
    """Per metric, each node's value, the spread (max / min - 1) and, for times (unit s), the slowest node."""
    metrics: dict[str, dict[str, Any]] = {}
    for rank, data in sorted(found.items()):
        for name, m in (data.get("metrics") or {}).items():
            v = m.get("value") if isinstance(m, dict) else None
            if isinstance(v, int | float) and not isinstance(v, bool):
                row = metrics.setdefault(name, {"unit": m.get("unit", ""), "source": m.get("source", ""),
                                                "values": {}})
                row["values"][str(rank)] = v
    for row in metrics.values():
        vals = row["values"]
        lo, hi = min(vals.values()), max(vals.values())
        row["spread"] = hi / lo - 1 if len(vals) > 1 and lo > 0 else None
        row["median"] = statistics.median(vals.values())
        row["slowest_node"] = int(max(vals, key=vals.get)) if row["unit"] == "s" and len(vals) > 1 else None
    missing = [k for k in range(count) if k not in found]
    hosts = {str(k): d.get("node", {}).get("host", "") for k, d in sorted(found.items())}
    step = next((metrics[k] for k in ("step_time_median_s", "step_median_s") if k in metrics), None)
    text = f"{len(found)} of {count} nodes reported"
    if step and step["slowest_node"] is not None:
        s = step["slowest_node"]
        text += (f"; slowest node {s} ({hosts.get(str(s), '?')}) at {step['values'][str(s)] * 1e3:.1f} ms per step, "
                 f"spread across nodes {step['spread']:.1%} (max / min - 1)")
    if missing:
        text += f"; missing: node {', '.join(map(str, missing))} (no file yet: rerun mfu-lab report to merge it)"
    return {"count": count, "reported": sorted(found), "missing": missing, "hosts": hosts, "metrics": metrics,
            "text": text, "shown": "node 0's figures; the others are summarised here"}


def merge_into(result_path: Path, count: int) -> dict[str, Any] | None:
    """Node 0's result.json with the ``nodes`` summary of the files there now; None when there are no node files."""
    step_dir = Path(result_path).parent
    found = node_files(step_dir)
    if not found:
        return None
    data = read_json(result_path)
    data["nodes"] = summary(found, max(count, max(found) + 1))
    return data
