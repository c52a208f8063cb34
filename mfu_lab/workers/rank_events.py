"""What a rank leaves for its launcher while it runs: the node's progress file (``<out>/progress.jsonl``, one JSON line
per event, written by local rank 0) and each rank's heartbeat (``<out>/beats/rank<k>.json``, its last reached
configuration and step). The launcher's watchdog (:mod:`mfu_lab.workers.launch`) reads both: progress tells it the
launch moves on, the heartbeats name the rank that stopped. Step 2's DDP ranks and step 6's layout ranks write them.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from mfu_lab.core.store.files import write_atomic

BEAT_S = 1.0  # a timed step's progress line and heartbeat at most once a second (the watchdog waits a minute)


def emit(out: Path, event: dict, durable: bool = True) -> None:
    """Append an event to this node's progress file (local rank 0 writes; each node has its own launcher).
    ``durable=False`` (the per-step lines written between timed steps) skips the fsync: on NFS or Lustre its
    latency would land in the next step's wall time."""
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        with open(out / "progress.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()
            if durable:
                os.fsync(f.fileno())


def step_beat(out: Path, rank: int, where: dict, fields: dict, every_s: float = BEAT_S, clock=time.monotonic):
    """``beat(done, total, *_)`` for a timed loop's progress callback: a ``step`` event (not fsynced) and this rank's
    heartbeat, at most once per ``every_s`` and at the last step. It runs between timed steps, where its time
    falls into the next step's wall, so it stays rare and cheap; a hang is then placed to within ``every_s`` of
    steps."""
    last = [float("-inf")]

    def beat(done: int, total: int, *_: object) -> None:
        now = clock()
        if done < total and now - last[0] < every_s:
            return
        last[0] = now
        emit(out, {"event": "step", **fields, "done": done, "total": total}, durable=False)
        heartbeat(out, rank, where["config"], done)

    return beat


def heartbeat(out: Path, rank: int, config: int, step: int) -> None:
    """Every rank's last reached point, one small file per rank: a hung launch can then name the rank that
    stopped (the launcher reads them when it ends the launch)."""
    write_atomic(out / "beats" / f"rank{rank}.json", json.dumps(
        {"rank": rank, "host": socket.gethostname(), "config": config, "step": step, "t": time.time()}),
        durable=False)
