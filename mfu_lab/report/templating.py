"""The Jinja2 environment every HTML page and fragment of the report is rendered with.

Templates live in ``mfu_lab/report/templates/`` (``*.html.j2``; ``offline/`` is nbconvert's notebook template).
Autoescaping is on: every value a template prints is escaped unless it is :class:`markupsafe.Markup` (a nested
fragment, a badge, a plot's ``<img>``). Escaping goes through :func:`html.escape`, as the report always has,
so a page's text does not change with the templating (``'`` as ``&#x27;``, ``"`` as ``&quot;``).
"""

from __future__ import annotations

import html
import re
from functools import cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from mfu_lab.core.measure.ledger import LABELS, RENAMED
from mfu_lab.report.format import badge, compile_s, duration, flagged, fmt, ms, ms0, num, share

TEMPLATES = Path(__file__).parent / "templates"


def _finalize(value: Any) -> Any:
    """Escape what a template prints with :func:`html.escape` (Markup passes through as it is)."""
    if hasattr(value, "__html__"):
        return value
    return Markup(html.escape(str(value)))


CELL = re.compile(r"(<td\b[^>]*>)(.*?)(</td>)", re.S)
TEXT = re.compile(r"(^|<[^>]*>)([^<]+)")  # a text node and the tag before it
LONG = re.compile(r"[^\s<>]{25,}")  # a token too long for a narrow column: an operator chain, a path
BREAK_AFTER = re.compile(r"([+_/.,:=])(?=\w)")
UNIT_SPAN = '<span class="nu">'  # a number and its unit, kept on one line (part.css)
SKIP_CELL = re.compile(r"<(?:script|style|svg|textarea)\b|<!--", re.I)  # not text to wrap: left as it is
WITH_UNIT = re.compile(r"(?<![\w.+-])(-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)? (?:[µm]?s|min|h|days|steps|GPUs?"
                       r"|ranks|nodes|[kMGTP]?i?(?:FLOP/s|FLOP|B/s|B|tokens/s|samples/s|tokens|samples)))(?![\w/])")


def wrap_cells(page: str) -> str:
    """``page`` with its table cells' text made to wrap where a reader expects: a number stays on the line of its
    unit ("821.4 µs", never "821.4" above "µs"), and a long token gets a line-break opportunity (``<wbr>``) after
    each ``+ _ / . , : =``, so that an operator chain such as ``transpose+expand+view+bmm+...`` wraps at its joins.
    The part CSS can then keep every shorter word whole (``overflow-wrap: break-word``, never ``anywhere``, which
    squeezed columns into "exclude|d") without a table running off the page. Tags, attributes, text outside the
    cells and the text a reader copies are unchanged; a cell holding a script, a style, an SVG, a text area or a
    comment is left whole; applying it twice changes nothing."""
    def text(t: re.Match) -> str:
        done = t.group(1) in (UNIT_SPAN, "<wbr>")  # a unit's span, or the rest of a token broken on a pass before
        body = t.group(2) if done else WITH_UNIT.sub(UNIT_SPAN + r"\1</span>", t.group(2))
        return t.group(1) + LONG.sub(lambda w: BREAK_AFTER.sub(r"\1<wbr>", w.group()), body)

    def cell(m: re.Match) -> str:
        return m.group(0) if SKIP_CELL.search(m.group(2)) else m.group(1) + TEXT.sub(text, m.group(2)) + m.group(3)

    return CELL.sub(cell, page)


def _pct(v: float | None, spec: str = ".1%") -> str:
    return "" if v is None else format(v, spec)


@cache
def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, finalize=_finalize, trim_blocks=True,
                             lstrip_blocks=True, keep_trailing_newline=True)
    env.globals.update(badge=badge, fmt=fmt, flagged=flagged, ledger_label=ledger_label)
    env.filters.update(ms=ms, ms0=ms0, num=num, pct=_pct, compile_s=compile_s, duration=duration, share=share)
    return env


def render(template: str, **context: Any) -> Markup:
    """A whole template rendered with ``context``, as safe HTML."""
    return Markup(wrap_cells(environment().get_template(template).render(**context)))


def ledger_label(name: str) -> str:
    """A ledger item's name as people read it ("compute efficiency loss"), an earlier run's name included."""
    return LABELS.get(RENAMED.get(name, name), name)


def macros(template: str) -> Any:
    """A template's macros, callable from Python: ``macros("tables_kernels.html.j2").top_table(a)``."""
    return environment().get_template(template).module

