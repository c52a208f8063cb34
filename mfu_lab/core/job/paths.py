"""Where the workbook's own files are, and where a job's relative paths point.

The notebooks (``notebooks/*.ipynb``) and the shipped job and cluster files (``parameters/``) live at the root of a
checkout, which is their source of truth. An installed package (``pip install .``, not editable) has no checkout:
the build (``setup.py``) copies them into the package as ``mfu_lab/_workbook/notebooks`` and
``mfu_lab/_workbook/parameters``. :func:`workbook_file` finds one of them: the checkout's when the package runs from
a checkout (an editable install, or ``python -m mfu_lab`` in the checkout), else the packaged copy.

A job's relative paths (README, "Job files"):

- ``out_dir``: from the checkout holding the job file; a job file outside any checkout (and the embedded default
  job): from the checkout holding the current folder, else the current folder;
- ``cluster`` and ``monitor_dir``: the first that exists of the job file's folder (a key written in the file), the
  checkout holding the job file, the checkout holding the current folder (else the current folder), and, for
  ``cluster`` only, the workbook's own files (:func:`workbook_file`).

:func:`anchored_paths` turns a job file's relative paths into absolute ones where the job file's folder decides
where they point, so the job keeps its meaning in any process (a notebook's kernel, a worker) whatever its folder.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2]  # the mfu_lab folder (this is mfu_lab/core/job/paths.py)
PACKAGED = PACKAGE / "_workbook"  # the build's copy of notebooks/ and parameters/ (an installed package)
MARKER = Path("notebooks") / "01_baseline.ipynb"
INPUT_KEYS = ("cluster", "monitor_dir")  # relative paths to things that exist; out_dir is made
PATH_PREFIXES = ("tokens:", "hf:")  # the data key's file kinds: tokens:PATH, hf:PATH


def is_checkout(folder: Path) -> bool:
    """A workbook checkout: ``notebooks/01_baseline.ipynb`` beside ``parameters/``. The installed package's own copy
    (``mfu_lab/_workbook``) is not one: outputs never go inside an installed package."""
    return (folder / MARKER).is_file() and (folder / "parameters").is_dir() and folder.resolve() != PACKAGED


def checkout_of(start: Path) -> Path | None:
    """The checkout holding ``start`` (itself or a parent), None when there is none."""
    start = start.resolve()
    return next((d for d in (start, *start.parents) if is_checkout(d)), None)


def find_workbook_root(start: Path | None = None) -> Path:
    """The mfu-lab checkout containing ``start`` (default: cwd), else ``start`` itself.

    This makes ``out_dir: outputs`` mean the same folder whether the notebook runs from the repository root (CLI,
    papermill) or from ``notebooks/`` (JupyterLab).
    """
    start = (start or Path.cwd()).resolve()
    return checkout_of(start) or start


def package_checkout() -> Path | None:
    """The checkout this package runs from (its parent folder), None for an installed package."""
    return PACKAGE.parent if is_checkout(PACKAGE.parent) else None


def workbook_file(relative: str | Path) -> Path:
    """One of the workbook's own files (``notebooks/01_baseline.ipynb``, ``parameters/default.yaml``...): the
    checkout's when the package runs from one, else the copy packaged with it. The path may not exist."""
    return (package_checkout() or PACKAGED) / relative


def _path(value: str) -> Path:
    """``value`` as a path, ``~`` expanded where it can be (``~nosuchuser`` stays as written)."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        return Path(value)


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except (OSError, ValueError):  # a name too long for the file system, a NUL character: nothing is there
        return False


def input_path(value: str, key: str, file_folder: Path | None = None, job_checkout: Path | None = None,
               root: Path | None = None) -> Path:
    """Where the relative path ``value`` of job key ``key`` (cluster, monitor_dir) points: the first that exists of
    ``file_folder / value`` (the job file's folder, for a key written in the file), ``job_checkout / value`` (the
    checkout holding the job file), under ``root`` (default: :func:`find_workbook_root`) and, for ``cluster``, the
    workbook's own file (:func:`workbook_file`). When none exists: under the job's checkout, else the job file's
    folder, else the workbook root (where a missing file is then reported)."""
    p = _path(value)
    if p.is_absolute():
        return p
    root = root or find_workbook_root()
    bases = [b for b in (file_folder, job_checkout) if b is not None] + [root]
    candidates = [b / p for b in dict.fromkeys(bases)] + ([workbook_file(p)] if key == "cluster" else [])
    return next((c for c in candidates if _exists(c)), (job_checkout or file_folder or root) / p)


def output_base(job_checkout: Path | None = None) -> Path:
    """The folder a relative ``out_dir`` starts from: the checkout holding the job file, else the workbook root
    (the current folder's checkout, else the current folder)."""
    return job_checkout or find_workbook_root()


def job_file_folder(path: Path) -> Path | None:
    """The folder a job file's relative paths start from: its own, or None for the workbook's packaged default job
    (inside an installed package), which behaves as the embedded default job."""
    folder = path.resolve().parent
    return None if folder == PACKAGED or PACKAGED in folder.parents else folder


def anchored_paths(values: dict, path: Path, written: set[str]) -> dict[str, str]:
    """The path keys of a job loaded from ``path`` that must become absolute to keep their meaning elsewhere:
    ``{key: absolute path}`` for each relative ``cluster``, ``monitor_dir`` and ``out_dir`` whose place, taken
    from the job file (:func:`input_path`, :func:`output_base`), differs from the place the same text takes
    without it (in a notebook's kernel, say). ``values``: the job's keys; ``written``: those the file itself
    gives (not a default, not a command-line override)."""
    folder = job_file_folder(path)
    if folder is None:
        return {}
    home = checkout_of(folder)
    out: dict[str, str] = {}
    for key in INPUT_KEYS:
        value = values.get(key) or ""
        if not value or _path(value).is_absolute():
            continue
        there = input_path(value, key, folder if key in written else None, home)
        if there != input_path(value, key):
            out[key] = str(there)
    # the data's file and tokenizer folder: always absolute, so a tuned.yaml written elsewhere reads the same data
    data = values.get("data") or ""
    prefix = next((p for p in PATH_PREFIXES if data.startswith(p)), "")
    if prefix and not _path(data[len(prefix):]).is_absolute():
        there = input_path(data[len(prefix):], "data", folder if "data" in written else None, home)
        out["data"] = prefix + os.path.normpath(there)
    value = values.get("tokenizer") or ""
    if value and not _path(value).is_absolute():
        out["tokenizer"] = os.path.normpath(input_path(value, "tokenizer", folder if "tokenizer" in written else None,
                                                       home))
    value = values.get("out_dir") or ""
    if value and not _path(value).is_absolute() and output_base(home) != output_base():
        out["out_dir"] = str(output_base(home) / _path(value))
    return out
