"""Rewrite the tagged parameters cell of every notebook from mfu_lab.core.job.schema.Job.

    python tools/sync_parameters.py

Run after adding or changing a job key: every notebook takes every key (so one
job file drives them all), and tests/test_job.py checks they match.
"""

import json
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mfu_lab.core.job.schema import FIELDS, KEY_GROUPS, Job  # noqa: E402
from mfu_lab.core.registry import STEPS  # noqa: E402


def parameters_source() -> str:
    job = Job()
    lines = ["# Job parameters: papermill -f JOB.yaml or -p key value replace these; defaults: parameters/default.yaml"]
    for name, f in FIELDS.items():
        if name in KEY_GROUPS:
            lines.append(f"# --- {KEY_GROUPS[name]} ---")
        t = f.type if isinstance(f.type, str) else f.type.__name__
        t = '"Optional[float]"' if t == "float | None" else t  # quoted: papermill reads it, Python skips it
        v = getattr(job, name)
        lit = json.dumps(v) if isinstance(v, str) else repr(v)
        lines.append(f"{name}: {t} = {lit}  # {f.metadata['help']}")
    return "\n".join(lines)


def main() -> None:
    src = parameters_source()
    for path in [ROOT / "notebooks" / info.notebook for info in STEPS]:  # 00_monitor takes a folder, not a job
        nb = nbformat.read(path, as_version=4)
        cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        if cell.source != src:
            cell.source = src
            nbformat.write(nb, path)
            print(f"updated {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
