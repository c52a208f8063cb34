"""Each executed notebook as a self-contained HTML report (nbconvert with the ``offline`` template)."""

from __future__ import annotations

from pathlib import Path

from mfu_lab.core.files import write_atomic
from mfu_lab.report.templating import TEMPLATES


def export_html(notebook: Path, html_path: Path) -> Path:
    """Executed notebook -> self-contained HTML (no script or style fetched from the network)."""
    # nbconvert takes seconds to import; the index is rewritten after every step's save, without it.
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook), as_version=4)
    # The offline template embeds no widget manager, so a widget view could not render: every output
    # that also carries HTML (the explorers' static fallback) shows that instead.
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "text/html" in data:
                data.pop("application/vnd.jupyter.widget-view+json", None)
    exporter = HTMLExporter(template_name="offline", extra_template_basedirs=[str(TEMPLATES)])
    exporter.exclude_input_prompt = True
    exporter.exclude_output_prompt = True
    body, _ = exporter.from_notebook_node(nb)
    return write_atomic(Path(html_path), body)
