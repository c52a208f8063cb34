"""Where the code a job names may come from: the one rule for a factory (``model: package.module:function``; the
data and loss factories of issue 30 are to use it too).

A job file that names code runs that code, so a factory's module must be, in this order of search:

(a) a ``.py`` file or package folder beside the job file (the job's own folder);
(b) in a folder the job lists in ``factory_paths`` (a relative one is taken from the job's own folder);
(c) a module of an installed package the job names in ``trust`` (top-level names, e.g. ``trust: [transformers]``).

Never a module of ``mfu_lab`` itself nor of Python's standard library, even when trusted or listed, and never an
installed package's module reached through ``factory_paths`` (that needs ``trust``). The job's own folder is the
job file's folder; a job without one (built in Python, the embedded default job, a notebook's papermill
parameters) takes the current folder. :func:`anchored_factory_paths` writes a job file's folder into its
``factory_paths`` when its factory lies there, so the job keeps its meaning in a notebook's kernel or a worker,
whose current folder differs.

:func:`factory_problem` finds the module without importing it (``importlib.machinery.PathFinder`` over the
allowed folders, walking the dotted parts through each package's ``submodule_search_locations``: no parent
package is imported); :func:`load_factory` refuses the same things again at load time and imports the module from
the place the rule found, with only that folder put on ``sys.path``.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.machinery
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.core.errors import JobProblem, StepError
from mfu_lab.core.job.paths import PACKAGE, find_workbook_root

RULE = ("a factory's module must be a .py file or package folder beside the job file, in a folder listed in "
        "factory_paths, or in an installed package named in trust; never mfu_lab's own code or Python's standard "
        "library")
_INSTALLED = ("site-packages", "dist-packages")


@dataclass(frozen=True)
class Found:
    """Where the rule found a factory's module: its file, the folder searched, and by which part of the rule."""

    origin: Path
    base: Path
    how: str  # "beside the job file" | "factory_paths" | "trust"


def job_folder(folder: Path | str | None) -> Path:
    """The job's own folder: the job file's folder, or the current folder for a job without a file."""
    return Path(folder or Path.cwd()).expanduser().resolve()


def listed_folders(folder: Path | str | None, factory_paths: list) -> list[Path]:
    """The folders of ``factory_paths``, a relative one taken from the job's own folder."""
    return [(job_folder(folder) / Path(p).expanduser()).resolve() for p in factory_paths]


def stdlib_name(top: str) -> bool:
    return top == "builtins" or top in sys.stdlib_module_names


def _under(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _stdlib_place(path: Path) -> bool:
    """A file of the standard library (not of a site-packages below it, as a venv's lib/pythonX.Y holds)."""
    if any(part in _INSTALLED for part in path.parts):
        return False
    roots = {Path(p).resolve() for p in (sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")) if p}
    return any(_under(path, r) for r in roots)


def _descend(spec: Any, parts: list[str]) -> Any:
    """The spec of ``parts`` (a dotted name) below the top-level ``spec``, through each package's
    submodule_search_locations; None when a part is missing. Imports nothing."""
    for i in range(1, len(parts)):
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), list(spec.submodule_search_locations))
    return spec if spec is not None and spec.origin and spec.has_location else None


def _walk(module: str, bases: list[str]) -> tuple[Any, str] | None:
    """The spec of dotted ``module`` and the base it was found under, searching ``bases`` in order; nothing is
    imported (PathFinder over the bases, then each part through the package's submodule_search_locations)."""
    parts = module.split(".")
    for base in bases:
        spec = _descend(importlib.machinery.PathFinder.find_spec(parts[0], [base]), parts)
        if spec is not None:
            return spec, base
    return None


def _skipped(folder: Path | str | None) -> set[Path]:
    return {Path.cwd().resolve(), find_workbook_root(), job_folder(folder)}


def _installed_bases(folder: Path | str | None) -> list[str]:
    """``sys.path`` without the current folder, the workbook root and the job's own folder: where installed
    packages are."""
    skip = _skipped(folder)
    out = []
    for p in sys.path:
        if not p:
            continue
        try:
            if Path(p).resolve() in skip:
                continue
        except (OSError, ValueError):
            pass
        out.append(p)
    return out


def _find_installed(module: str, folder: Path | str | None) -> tuple[Any, str] | None:
    """An installed package's module and the sys.path entry it is under: PathFinder over :func:`_installed_bases`,
    else the other finders on ``sys.meta_path`` (an editable install's) for the top-level name, which imports
    nothing, then down from there."""
    found = _walk(module, _installed_bases(folder))
    if found is not None:
        return found
    top = _meta_path_spec(module.split(".")[0])
    if top is not None and not any(p in _INSTALLED for p in Path(top.origin).parts) and any(
            _under(Path(top.origin).resolve(), Path(b)) for b in _skipped(folder)):
        top = None  # a finder (pytest's) that looks in the current folder too: not an installed package
    spec = _descend(top, module.split(".")) if top is not None else None
    return (spec, str(Path(top.origin).parent.parent if top.submodule_search_locations else Path(top.origin).parent)) \
        if spec is not None else None


def _meta_path_spec(top: str) -> Any:
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or isinstance(finder, type) and issubclass(
                finder, (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter)):
            continue
        find = getattr(finder, "find_spec", None)
        try:
            spec = find(top, None) if find else None
        except Exception:  # noqa: BLE001 - a third-party finder's own failure: not found
            spec = None
        if spec is not None and spec.origin and spec.has_location:
            return spec
    return None


def _why(what: str, allow: str = "") -> str:
    return f"{what} (the rule: {RULE})" + (f"; {allow}" if allow else "")


def locate(spec: str, folder: Path | str | None, factory_paths: list, trust: list,
           key: str = "model") -> tuple[Found | None, str | None]:
    """Where ``spec`` (``package.module:function``) may be imported from under the rule: (Found, None), or
    (None, why it is refused, saying what would allow it). Imports nothing."""
    module = spec.split(":")[0]
    top = module.split(".")[0]
    here = job_folder(folder)
    allow = (f"put {top}.py (or a {top}/ package folder) beside the job file ({here}), list its folder in "
             f"factory_paths, or, for an installed package, add '{top}' to trust")
    if top == "mfu_lab":
        return None, _why(f"names mfu_lab's own code ({module})")
    if stdlib_name(top):
        return None, _why(f"names a function of Python's standard library ({top}): a job file that names code "
                          "runs that code", "not through trust or factory_paths either; a file of your own with "
                          "that name must be renamed")
    bases = [(here, "beside the job file")] + [(p, "factory_paths") for p in listed_folders(folder, factory_paths)]
    for base, how in bases:
        hit = _walk(module, [str(base)])
        if hit is None:
            continue
        origin = Path(hit[0].origin).resolve()
        if _under(origin, PACKAGE):
            return None, _why(f"{module} is mfu_lab's own code ({origin})")
        if _stdlib_place(origin):
            return None, _why(f"{module} is a file of Python's standard library ({origin})")
        if any(part in _INSTALLED for part in origin.parts) and top not in trust:
            return None, _why(f"{module} is an installed package's module ({origin}), reached through {how}",
                              f"an installed package is allowed only by naming it in trust (trust: [{top}])")
        return Found(origin, base, how), None
    if top in trust:
        hit = _find_installed(module, folder)
        if hit is None:
            return None, _why(f"trust names '{top}', but no installed module {module} was found (looked in "
                              "sys.path without the current folder and the workbook root; nothing was imported)")
        origin = Path(hit[0].origin).resolve()
        if _under(origin, PACKAGE) or _stdlib_place(origin):
            return None, _why(f"{module} ({origin}) is mfu_lab's own code or Python's standard library")
        return Found(origin, Path(hit[1]), "trust"), None
    looked = f"beside the job file ({here})" + (
        f" nor in factory_paths ({', '.join(str(b) for b, _ in bases[1:])})" if factory_paths else "")
    if _find_installed(module, folder) is not None:
        return None, _why(f"{module} is a module of the installed package '{top}', which the job does not trust: "
                          "a job file that names code runs that code", f"to allow it, add '{top}' to trust "
                          f"(trust: [{top}]), only if you trust this job file")
    return None, _why(f"no module {module} {looked}", allow)


def factory_problem(spec: str, folder: Path | str | None, factory_paths: list, trust: list) -> str | None:
    """Why ``spec`` may not be a factory under the rule, None when it may. Imports nothing."""
    return locate(spec, folder, factory_paths, trust)[1]


def factory_key_problems(values: Any, bad: set[str], folder: Path | str | None,
                         keys: tuple[str, ...] = ("model",)) -> list[JobProblem]:
    """The job's factory keys (``keys``) and its ``factory_paths`` against the rule, for :func:`validate`; a key in
    ``bad`` (refused already) is skipped. ``values``: the Job."""
    problems: list[JobProblem] = []
    if "factory_paths" not in bad:
        for given, path in zip(values.factory_paths, listed_folders(folder, values.factory_paths)):
            if not path.is_dir():
                problems.append(JobProblem("factory_paths", values.factory_paths,
                                           f"item {given!r}: no such folder ({path}); a relative path is taken from "
                                           f"the job file's folder ({job_folder(folder)})"))
                return problems
    if bad & {"factory_paths", "trust"}:
        return problems
    for key in keys:
        spec = getattr(values, key)
        if key in bad or spec == "gpt":
            continue
        why = factory_problem(spec, folder, values.factory_paths, values.trust)
        if why:
            problems.append(JobProblem(key, spec, why))
    return problems


def anchored_factory_paths(spec: str | tuple[str, ...], folder: Path | None, factory_paths: list) -> list[str] | None:
    """A job file's ``factory_paths`` as absolute folders, with the file's own folder first when a module of
    ``spec`` (one ``package.module:function`` or several: the model, data and loss factories) lies there, so a
    kernel or worker in another folder finds it; None when nothing changes."""
    if folder is None:
        return None
    out = [str(p) for p in listed_folders(folder, factory_paths)]
    specs = (spec,) if isinstance(spec, str) else spec
    if any(s != "gpt" and ":" in s and _walk(s.split(":")[0], [str(job_folder(folder))]) is not None
           for s in specs):
        if str(job_folder(folder)) not in out:
            out.insert(0, str(job_folder(folder)))
    return out if out != list(factory_paths) else None


def load_factory(spec: str, folder: Path | str | None, factory_paths: list, trust: list,
                 key: str = "model") -> Callable:
    """The function ``spec`` names, imported from where the rule found its module (only that folder is put on
    ``sys.path``, at the front); a refused spec raises StepError naming the rule, the key and the value."""
    found, why = locate(spec, folder, factory_paths, trust, key)
    if found is None:
        raise StepError(f"job key '{key}' = {spec!r}: {why}; it is not imported")
    module_name, func_name = spec.split(":")
    base = str(found.base)
    if found.how == "trust":  # an installed package: its folder first for this import only
        sys.path.insert(0, base)
    elif base not in sys.path:
        sys.path.insert(0, base)  # kept: a worker spawned from here imports it by name too
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise StepError(f"job key '{key}' = {spec!r}: cannot import module '{module_name}' from {found.origin}: "
                        f"{e}") from e
    finally:
        if found.how == "trust":
            sys.path.remove(base)
    origin = getattr(getattr(module, "__spec__", None), "origin", None) or getattr(module, "__file__", None)
    if not origin or Path(origin).resolve() != found.origin:
        raise StepError(f"job key '{key}' = {spec!r}: module '{module_name}' is already imported from {origin}, not "
                        f"from {found.origin} where the rule found it ({found.how}); rename your module")
    func = getattr(module, func_name, None)
    if not callable(func):
        raise StepError(f"job key '{key}' = {spec!r}: module '{module_name}' has no function '{func_name}'")
    return func


def source_digest(spec: str, factory_paths: list, trust: list, folder: Path | str | None = None) -> str:
    """16 hex digits of the source file of the module ``spec`` names, found under the rule and not imported: what a
    cache of something a factory made is keyed on, so an edited factory is not served its old output. '' for a spec
    that names no code (``''``, ``gpt``); a module the rule refuses or cannot read gets a word of its own (nothing
    is served under it either: the factory then fails to load)."""
    if not spec or ":" not in spec:
        return ""
    found = locate(spec, folder, list(factory_paths), list(trust))[0]
    if found is None:
        return "refused"
    try:
        return hashlib.sha256(found.origin.read_bytes()).hexdigest()[:16]
    except OSError:
        return "unreadable"


CALLS = {"model": "{func}(**model_kwargs)", "data": "{func}() (with rank and world_size when it takes them)",
         "loss": "{func}(output, batch) at every step"}


def code_notes(job: Any, folder: Path | str | None) -> list[str]:
    """validate's notes on the code a job names (its model, data and loss factories): which module each step will
    import from where and what it calls; and, for a factory model, which shape keys are read from the model."""
    from mfu_lab.core.job.rules import factory_keys

    out = []
    for key in factory_keys(job):
        spec = getattr(job, key)
        if spec == "gpt":
            continue
        module, func = spec.split(":")
        found = locate(spec, folder, job.factory_paths, job.trust, key)[0]
        where = f"{found.origin}, {found.how}" if found else "where the rule allows"
        out.append(f"note: this job names code ({key}). Every step will import the module '{module}' ({where}; "
                   f"README, 'Your own model and data') and call {CALLS[key].format(func=func)}: a job file that "
                   "names code runs that code, so run only job files you trust. validate did not import it.")
    if job.model != "gpt":
        heads = (" Its heads and blocks, which tp and pp must divide, are checked before a layout runs "
                 "(mfu_lab.core.engine.layout_check)." if job.tp > 1 or job.pp > 1 else "")
        vocab = "" if job.vocab_size else "; vocab_size 0: its input embedding's rows"
        out.append(f"note: n_layers, d_model and n_heads are read from the model (built on the meta device when "
                   f"step 6 or a layout needs them), not taken from this file{vocab}.{heads}")
    return out
