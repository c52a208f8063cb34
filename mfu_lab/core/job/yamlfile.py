"""Reading the workbook's YAML files (jobs, clusters, -p values) safely and with bounds.

- Safe loading only: a file cannot build Python objects.
- A file larger than :data:`MAX_BYTES`, or not UTF-8 text, is refused with its name.
- A key written twice in one mapping is refused, naming both lines (YAML would keep the last silently).
- A number written with colons (``1:30``) stays the text written: YAML 1.1 reads it as base 60 (``1:30`` is 90,
  ``1:30.5`` is 90.5), which no setting here means; a key that wants a number then refuses the text.
- Aliases are bounded: the document, with every alias expanded, may hold at most :data:`MAX_NODES` values.
  Nested aliases ("billion laughs") otherwise grow exponentially: nine levels of ten took 3.3 GB in a minute.

Every refusal is a :class:`YamlProblem` carrying what went wrong in words; callers turn it into their own
error naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mfu_lab.core.errors import short_repr

MAX_BYTES = 1_000_000  # a job or cluster file is a page of settings
MAX_NODES = 100_000  # values in the document with aliases expanded


class YamlProblem(ValueError):
    """Why a YAML text was refused, in words (the caller names the file)."""


MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """The safe loader, refusing a mapping that repeats a key. Merge keys (``<<: *base``) stay allowed: each
    mapping's own keys are checked once, before PyYAML merges the base's keys into it."""

    def __init__(self, stream):
        super().__init__(stream)
        self._checked: set[int] = set()

    def flatten_mapping(self, node):
        if id(node) not in self._checked:
            self._checked.add(id(node))
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # the base class reports unhashable keys itself
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise YamlProblem(f"key {short_repr(key, 60)} is given twice, on lines {seen[key]} and {line}; "
                                      "keep one")
                seen[key] = line
        super().flatten_mapping(node)

    def construct_yaml_int(self, node):
        text = self.construct_scalar(node)
        return text if ":" in text else super().construct_yaml_int(node)  # base 60 (1:30 -> 90): kept as text

    def construct_yaml_float(self, node):
        text = self.construct_scalar(node)
        return text if ":" in text else super().construct_yaml_float(node)


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)


def _expanded_size(root: yaml.Node) -> int:
    """Values in the document with every alias expanded, computed without expanding (aliases share nodes)."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise YamlProblem("an alias refers to a value that contains it (a recursive alias)")
        active.add(key)
        n = 1
        if isinstance(node, yaml.MappingNode):
            n += sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n += sum(size(v) for v in node.value)
        active.discard(key)
        sizes[key] = n
        if n > MAX_NODES:
            raise YamlProblem(f"expands to more than {MAX_NODES:,} values once its aliases (&name / *name) are "
                              "expanded; a settings file needs far fewer")
        return n

    return size(root)


def loads(text: str) -> Any:
    """A YAML text's value, under the bounds above."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is None:
            return None
        _expanded_size(root)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as e:
        raise YamlProblem(f"is not valid YAML: {e}") from None
    except RecursionError:
        raise YamlProblem("nests values too deeply") from None


def read_text(path: Path) -> str:
    """A settings file's text (YAML, or the plain-text files a cluster file names): refused when missing, larger
    than :data:`MAX_BYTES` (never more than that is read), or not UTF-8 text."""
    path = Path(path)
    size = path.stat().st_size
    raw = b""
    if size <= MAX_BYTES:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # bounded even where the size said less (a file that grew, a /proc file)
    if size > MAX_BYTES or len(raw) > MAX_BYTES:
        said = f"{size:,} bytes" if size > MAX_BYTES else f"more than {MAX_BYTES:,} bytes"
        raise YamlProblem(f"is {said}; a job or cluster file may hold at most {MAX_BYTES:,}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = raw[e.start:e.start + 1]
        raise YamlProblem(f"is not UTF-8 text (byte {e.start} is {bad!r}); save it as UTF-8") from None


def load(path: Path) -> Any:
    """A YAML file's value: refused when missing, too large, not UTF-8 text, or past the bounds above."""
    return loads(read_text(path))
