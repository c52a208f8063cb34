"""The result store: how a step saves its result and how a later step reads an earlier one.

A save writes ``<NN_step>/result.json`` atomically and appends the run-history line
(:mod:`mfu_lab.core.store.history`). Later steps read earlier ones through :func:`earlier`, by registry key,
never by folder name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import nodes
from mfu_lab.core.store.files import RESULT_FILE, DamagedFile, mark_job_root, read_json, write_json_atomic
from mfu_lab.core.store.history import record
from mfu_lab.core.store.nodes import this_node
from mfu_lab.core.store.results import jsonable
from mfu_lab.core.store.staging import staged, staging

# Called with the job's output folder after every save. The package facade (mfu_lab/__init__.py) registers the
# index refresh here, so a step run from plain Python leaves an up-to-date summary page while the core never
# imports the presentation layer.
AFTER_SAVE: list[Callable[[Path], None]] = []


@dataclass
class Earlier:
    """An earlier step's result as a later step reads it: the stored JSON, or why there is none."""

    key: str
    data: dict[str, Any] | None
    reason: str = ""  # why ``data`` is None, in words a report can show
    path: Path | None = None  # the result.json read

    def __bool__(self) -> bool:
        return self.data is not None

    def typed(self):
        """The step's own result class, rebuilt from the JSON (the registry names the module)."""
        if self.data is None:
            raise LookupError(self.reason)
        return BY_KEY[self.key].load().Result.from_dict(self.data)


def earlier(job, key: str) -> Earlier:
    """The latest result of step ``key`` for ``job`` (anything with ``output_root()``): the one way a step
    reads another's."""
    info = BY_KEY[key]
    path = Path(job.output_root()) / info.folder / RESULT_FILE
    if not path.is_file():
        return Earlier(key, None, f"step {info.number} ({key}) has not run for this job", path)
    try:
        return Earlier(key, read_json(path), "", path)
    except DamagedFile as e:  # later steps go on as if it had not run, and say why
        return Earlier(key, None, str(e), path)


def save(job, key: str, result, env: dict[str, str] | None = None) -> Path:
    """Write a step's result.json atomically and its run-history line, then tell the AFTER_SAVE hooks.

    On a multi-node job (``nnodes`` > 1) every node writes ``nodes/node<k>.json`` first; only node 0 writes
    result.json, with the other nodes' figures summarised beside its own (:mod:`mfu_lab.core.store.nodes`). The other
    nodes return their own file and leave the history and the index to node 0. Inside the runner's bracket
    (:mod:`mfu_lab.core.store.staging`) the result is written as ``result.json.staged``, published by the bracket."""
    info = BY_KEY[key]
    mark_job_root(job.output_root())
    step_dir = job.step_dir(info.folder)
    data = jsonable(result)
    count = getattr(job, "nnodes", 1) or 1
    if count > 1:
        node = this_node(count, env)
        data["node"] = {"rank": node.rank, "host": node.host, "how": node.how}
        own = write_json_atomic(node.file(step_dir), data)
        if not node.owns_result:
            return own
        data["nodes"] = nodes.summary(nodes.wait_for(step_dir, count, nodes.WAIT_S), count)
    if staging():  # the runner's bracket publishes the result, its history line and the index (core.store.staging)
        return write_json_atomic(staged(step_dir / RESULT_FILE), data)
    path = write_json_atomic(step_dir / RESULT_FILE, data)
    record(job.output_root(), info.folder, info.key, read_json(path))
    for hook in AFTER_SAVE:
        hook(job.output_root())
    return path
