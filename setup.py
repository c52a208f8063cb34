"""Build hook: the workbook's notebooks and shipped job files go inside the package.

``notebooks/`` and ``parameters/`` stay at the repository root (their source of truth, which the README, the tests
and the tools name). A wheel (``pip install .``) gets a copy of them as ``mfu_lab/_workbook/notebooks`` and
``mfu_lab/_workbook/parameters``, so an installed ``mfu-lab`` runs from any folder; an sdist carries them at its
root, so a wheel built from it gets them too. An editable install (``pip install -e .``) copies nothing: the
package runs from the checkout and uses the checkout's own folders (``mfu_lab.core.job.paths.workbook_file``).
Everything else about the package is in ``pyproject.toml``.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
PACKAGED = Path("mfu_lab") / "_workbook"  # mfu_lab.core.job.paths.PACKAGED
SHIPPED = ("notebooks/*.ipynb", "parameters/*.yaml", "parameters/clusters/*")


def workbook_files() -> list[Path]:
    """The shipped files, relative to the source root; an error when the notebooks are not there (a wheel without
    them would fail only when a user runs it)."""
    files = sorted({p.relative_to(HERE) for pattern in SHIPPED for p in HERE.glob(pattern) if p.is_file()})
    if Path("notebooks/01_baseline.ipynb") not in files or Path("parameters/default.yaml") not in files:
        raise FileNotFoundError(f"{HERE}: notebooks/01_baseline.ipynb or parameters/default.yaml missing; build "
                                "mfu-lab from a full checkout (or its sdist)")
    return files


class BuildPyWithWorkbook(build_py):
    """``build_py`` that also copies the notebooks and job files into ``<build_lib>/mfu_lab/_workbook``."""

    def _workbook_mapping(self) -> dict[str, str]:
        return {str(Path(self.build_lib) / PACKAGED / rel): str(HERE / rel) for rel in workbook_files()}

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the checkout's own notebooks/ and parameters/ are used
            return
        shutil.rmtree(Path(self.build_lib) / PACKAGED, ignore_errors=True)  # no file left from an earlier build
        for dst, src in self._workbook_mapping().items():
            self.mkpath(str(Path(dst).parent))
            self.copy_file(src, dst, preserve_mode=False)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, *self._workbook_mapping()]

    def get_output_mapping(self) -> dict[str, str]:
        return {**super().get_output_mapping(), **self._workbook_mapping()}


class SdistWithWorkbook(sdist):
    """``sdist`` that carries ``notebooks/`` and ``parameters/`` (the wheel built from it copies them in)."""

    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        for rel in workbook_files():
            dst = Path(base_dir) / rel
            if not dst.exists():  # never write through a hard link the release tree may hold
                self.mkpath(str(dst.parent))
                self.copy_file(str(HERE / rel), str(dst))


setup(cmdclass={"build_py": BuildPyWithWorkbook, "sdist": SdistWithWorkbook})
