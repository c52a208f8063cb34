"""The house's shape, enforced: layers only import downward (import-linter), no import cycles, no module of more
than 450 lines, every step module keeps the same contract, and no step folder name outside the registry; the floor
plan of issue 45 (rooms of at most 16 modules, each saying what lives there, a planted import caught)."""

import ast
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from mfu_lab.core.registry import STEPS

from .conftest import ROOT

PACKAGE = ROOT / "mfu_lab"
MAX_LINES = 450


def test_import_linter_contracts_are_kept():
    exe = Path(sys.executable).with_name("lint-imports")
    p = subprocess.run([str(exe) if exe.exists() else "lint-imports", "--no-cache"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "0 broken" in p.stdout


def _cycles(graph: grimp.ImportGraph, modules: set[str]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v) & modules:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(modules):
        if m not in index:
            visit(m)
    return out


def test_no_import_cycles():
    graph = grimp.build_graph("mfu_lab")
    modules = {m for m in graph.modules if m.startswith("mfu_lab.")}
    assert _cycles(graph, modules) == []


def test_cycle_finder_finds_a_cycle():
    graph = grimp.ImportGraph()
    for m in ("p.a", "p.b", "p.c"):
        graph.add_module(m)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert _cycles(graph, {"p.a", "p.b", "p.c"}) == [["p.a", "p.b"]]


def test_no_module_is_a_big_room():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in PACKAGE.rglob("*.py")}
    assert {k: v for k, v in sizes.items() if v > MAX_LINES} == {}


@pytest.mark.parametrize("info", STEPS, ids=[s.key for s in STEPS])
def test_every_step_module_keeps_the_contract(info):
    mod = importlib.import_module(info.module)
    params = inspect.signature(mod.run).parameters
    assert list(params)[:3] == ["job", "progress", "write"]
    assert params["progress"].default is None and params["write"].default is True
    assert len(inspect.signature(mod.advise).parameters) == 1  # advise(result)
    assert callable(mod.Result.from_dict) and isinstance(mod.Result.FORMAT, int)
    assert (ROOT / "notebooks" / info.notebook).is_file()


def test_step_folders_are_named_only_by_the_registry():
    folder = re.compile("|".join(re.escape(f'"{s.folder}"') for s in STEPS))
    found = [f"{p.relative_to(ROOT)}:{i}" for p in PACKAGE.rglob("*.py") if p.name != "registry.py"
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if folder.search(line)]
    assert found == []


# ---------------------------------------------------------------- the floor plan (issue 45)
NEAR_FLAG = 10  # a module within this many lines of MAX_LINES says in its opening docstring why it stays whole
MAX_SIDE_BY_SIDE = 16  # modules in one folder, its __init__ left out


def _modules_by_folder() -> dict[str, list[str]]:
    folders: dict[str, list[str]] = {}
    for p in PACKAGE.rglob("*.py"):
        if p.name != "__init__.py" and "_workbook" not in p.parts:
            folders.setdefault(str(p.parent.relative_to(ROOT)), []).append(p.name)
    return folders


def test_no_folder_holds_more_than_16_modules_side_by_side():
    assert {k: len(v) for k, v in _modules_by_folder().items() if len(v) > MAX_SIDE_BY_SIDE} == {}


def test_every_sub_package_says_what_lives_there():
    """Each room's __init__ opens with a docstring (what lives there, and what may not)."""
    silent = [str(p.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")
              if "_workbook" not in p.parts and not (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "")]
    assert silent == []


def test_a_module_near_the_line_flag_says_why_it_stays_whole():
    near = []
    for p in PACKAGE.rglob("*.py"):
        n = len(p.read_text(encoding="utf-8").splitlines())
        doc = ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or ""
        if n > MAX_LINES - NEAR_FLAG and "Kept whole:" not in doc:
            near.append(f"{p.relative_to(ROOT)} ({n} lines)")
    assert near == []


@pytest.mark.parametrize("info", STEPS, ids=[s.key for s in STEPS])
def test_each_step_package_offers_the_notebook_its_step(info):
    """The notebooks import ``mfu_lab.steps.<key>`` and call ``run``; the registry names the step module itself."""
    package = importlib.import_module(f"mfu_lab.steps.{info.key}")
    step = importlib.import_module(info.module)
    for name in ("run", "advise", "save", "Result"):
        assert getattr(package, name) is getattr(step, name)


def test_the_package_folder_is_found_from_its_rooms():
    """Paths computed from a module's own file: the workbook's files and the source digest see the whole package."""
    import mfu_lab
    from mfu_lab.core.job import paths

    assert paths.PACKAGE == Path(mfu_lab.__file__).resolve().parent


def test_a_store_module_importing_torch_breaks_a_contract(tmp_path):
    """The contracts bite: a copy of the package with one planted import (core.store -> torch) fails lint-imports,
    naming the contract, while the copy without it passes."""
    import shutil

    shutil.copytree(PACKAGE, tmp_path / "mfu_lab", ignore=shutil.ignore_patterns("__pycache__", "_workbook"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    exe = Path(sys.executable).with_name("lint-imports")
    cmd = [str(exe) if exe.exists() else "lint-imports", "--no-cache"]
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    clean = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert clean.returncode == 0, clean.stdout[-2000:]
    (tmp_path / "mfu_lab" / "core" / "store" / "planted.py").write_text("import torch\n")
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode != 0
    assert "import no torch" in p.stdout and "BROKEN" in p.stdout and "mfu_lab.core.store.planted" in p.stdout
