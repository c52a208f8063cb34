"""Importing the notebook libraries (papermill, nbformat, nbconvert) without a cost none of them uses.

nbformat imports jsonschema, and jsonschema's format checkers import ``rfc3987_syntax`` when it is installed
(JupyterLab's ``jsonschema[format-nongpl]`` brings it): that module builds 38 lark grammars at import, 3.2 s of a
4.3 s ``import papermill`` on a 2-core AMD EPYC (2026-12-03; 1.5 s for papermill and nbconvert together without
it). Only jsonschema's ``iri`` and ``iri-reference`` format checks use it, and neither nbformat's notebook schema
nor papermill checks formats. So, in the process that runs notebooks, the import is refused (``sys.modules[name]
= None``, the standard way to make an import fail) before jsonschema is first imported; jsonschema then leaves
those two checks out, as it does whenever the package is absent. Once jsonschema is in (someone needed it first),
nothing is changed.
"""

from __future__ import annotations

import sys

SLOW_OPTIONAL = "rfc3987_syntax"


def notebook_libraries() -> None:
    """Call before the first ``import papermill``, ``nbformat`` or ``nbconvert`` in a process."""
    if "jsonschema" not in sys.modules:
        sys.modules.setdefault(SLOW_OPTIONAL, None)
