"""Each executed notebook as a self-contained HTML report (nbconvert with the ``offline`` template), results first.

The report opens with "What this step found" (:mod:`.found`, from the step's ``result.json``), then the notebook's
narrative and outputs. Each code cell's source is folded under "show code" (a ``<details>``: no script, nothing
fetched). Stream outputs (progress and log lines) are left out of the HTML; they stay in the executed notebook.
Error outputs are always kept, and so are papermill's error banner, markdown, tables and plots.

The job's parameters appear once, at the end, inside a closed "Job parameters" ``<details>``: the job table (the
output of the cell ``job = from_namespace(...)``), else papermill's injected parameters as a key/value table, else
the parameters cell's source. The parameters cell, papermill's injected-parameters cell and the job cell leave
their place (a cell among them that raised stays where it is, with its error); the markdown cell that introduces
the job (a heading naming it, just before the job cell) goes with the table.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Any

from mfu_lab.core.process import quick_imports
from mfu_lab.core.store.files import DamagedFile, write_atomic
from mfu_lab.report.templating import TEMPLATES

PARAMETER_TAGS = {"parameters", "injected-parameters"}
JOB_CELL = re.compile(r"^\s*job\s*=\s*from_namespace\(", re.MULTILINE)
JOB_HEADING = re.compile(r"^\s*#+\s.*\bjob\b", re.IGNORECASE)
MARK = "mfu_lab_export"  # cell metadata read by the offline template: "open" / "close" the Job parameters block


def _errors(cell: Any) -> bool:
    return any(o.get("output_type") == "error" for o in cell.get("outputs", []))


def _job_table(cell: Any) -> bool:
    return any("text/html" in o.get("data", {}) for o in cell.get("outputs", []))


def _table_cell(rows: list[tuple[str, str]], caption: str) -> Any:
    """A cell that shows ``rows`` as a key/value table (values escaped here: nbconvert does not autoescape)."""
    from nbformat.v4 import new_code_cell, new_output

    body = "".join(f"<tr><td><code>{html.escape(k)}</code></td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    table = (f"<p><small>{html.escape(caption)}</small></p><table><tr><th>key</th><th>value</th></tr>"
             f"{body}</table>")
    return new_code_cell(source="", outputs=[new_output("display_data", data={"text/html": table,
                                                                                 "text/plain": caption})])


def _pre_cell(source: str, caption: str) -> Any:
    from nbformat.v4 import new_code_cell, new_output

    text = f"<p><small>{html.escape(caption)}</small></p><pre>{html.escape(source)}</pre>"
    return new_code_cell(source="", outputs=[new_output("display_data", data={"text/html": text,
                                                                                "text/plain": source})])


def arrange(nb: Any) -> Any:
    """The notebook as the report shows it (in place): stream outputs out, the job's parameters once, at the end,
    in cells marked for the template's closed "Job parameters" block."""
    kept, block, params_src = [], [], ""
    for cell in nb.cells:
        if cell.get("cell_type") == "code":
            cell["outputs"] = [o for o in cell.get("outputs", []) if o.get("output_type") != "stream"]
        tags = set(cell.get("metadata", {}).get("tags", []))
        is_code = cell.get("cell_type") == "code"
        if is_code and tags & PARAMETER_TAGS and not _errors(cell):
            if "parameters" in tags:
                params_src = cell.get("source", "")
            continue
        if is_code and not block and JOB_CELL.search(cell.get("source", "")) and _job_table(cell) \
                and not _errors(cell):
            intro = kept[-1] if kept and kept[-1].get("cell_type") == "markdown" else None
            if intro is not None and JOB_HEADING.match(intro.get("source", "")):
                block.append(kept.pop())
            block.append(cell)
            continue
        kept.append(cell)
    if not any(c.get("cell_type") == "code" for c in block):  # no job table: papermill's parameters, else the cell's
        injected = ((nb.metadata.get("papermill") or {}).get("parameters") or {})
        if injected:
            block.append(_table_cell([(str(k), repr(v)) for k, v in injected.items()],
                                     "the parameters papermill injected (the job table did not run)"))
        elif params_src.strip():
            block.append(_pre_cell(params_src, "the notebook's parameters cell (the job table did not run)"))
    if block:
        for c in block:
            c.setdefault("metadata", {})[MARK] = ""
        block[0]["metadata"][MARK] += "open "
        block[-1]["metadata"][MARK] += "close"
    nb.cells = kept + block
    return nb


def export_html(notebook: Path, html_path: Path, result: Path | None = None) -> Path:
    """Executed notebook -> self-contained HTML (no script or style fetched from the network), results first.
    ``result``: the step's result to summarise when it is not yet published (the runner's staged one)."""
    # nbconvert takes seconds to import; the index is rewritten after every step's save, without it.
    quick_imports.notebook_libraries()
    import nbformat
    from nbconvert import HTMLExporter

    from mfu_lab.report.found import found_html
    from mfu_lab.report.templating import wrap_cells

    try:
        nb = nbformat.read(str(notebook), as_version=4)
    except (ValueError, UnicodeDecodeError) as e:  # NotJSONError (a ValueError): papermill writes in place
        raise DamagedFile(Path(notebook), f"not a complete notebook: {type(e).__name__}: {str(e)[:120]}") from None
    # The offline template embeds no widget manager, so a widget view could not render: every output
    # that also carries HTML (the explorers' static fallback) shows that instead.
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/html" in data:
                data.pop("application/vnd.jupyter.widget-view+json", None)
                html_out = data["text/html"]  # a string, or a list of lines
                data["text/html"] = wrap_cells("".join(html_out) if isinstance(html_out, list) else html_out)
    arrange(nb)
    exporter = HTMLExporter(template_name="offline", extra_template_basedirs=[str(TEMPLATES)])
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    body, _ = exporter.from_notebook_node(nb, resources={"mfu_found": str(found_html(Path(notebook), result))})
    return write_atomic(Path(html_path), body)
