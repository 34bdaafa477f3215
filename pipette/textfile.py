"""Reading the files people give Pipette (job files, recipes, cluster files): bounded, UTF-8,
YAML without its dangerous corners, and one line saying what is wrong where.

PyYAML's safe loader still expands aliases: a 395-byte "billion laughs" file made
``pipette submit`` use 4.5 GB and 36 s, and a circular alias (``a: &a [*a]``) raised a
recursion traceback. Pipette's files never need anchors or aliases, so they are refused; a
key given twice is refused too (YAML would keep the last one silently); a file larger than
``MAX_BYTES`` or not UTF-8 is refused before it is parsed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node

from pipette.errors import SpecError

#: the largest file read (the service takes request bodies of 1 MiB)
MAX_BYTES = 1024 * 1024


class StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases and without duplicate keys."""

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None, None, "uses an alias (*name): Pipette's files do not need anchors or aliases; "
                "write the values out", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"gives the key {key!r} twice", key_node.start_mark)
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def read_text(path: str | Path, field: str, what: str, missing_fix: str | None = None) -> str:
    """The file's text: at most ``MAX_BYTES``, UTF-8; else one line naming the file
    (``missing_fix``: what to say when it cannot be read)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_BYTES:
            raise SpecError(f"{p} is {size:,} bytes, more than the {MAX_BYTES:,} a {what} may have", field=field,
                            fix=f"give a {what} of at most 1 MiB")
        raw = p.read_bytes()
    except OSError as e:
        raise SpecError(f"cannot read {str(p)!r} ({e.strerror})", field=field,
                        fix=missing_fix or f"give the path of a {what}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"{p} is not UTF-8 text (byte {e.start})", field=field,
                        fix=f"save the {what} as UTF-8 text") from None


def parse_yaml(text: str, where: str, field: str, fix: str) -> Any:
    """``text`` as YAML (JSON is YAML) with ``StrictLoader``; one line per error."""
    if len(text.encode()) > MAX_BYTES:
        raise SpecError(f"{where} is larger than {MAX_BYTES:,} bytes", field=field, fix="give at most 1 MiB")
    try:
        return yaml.load(text, Loader=StrictLoader)  # StrictLoader is a SafeLoader
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecError(f"{where} is not valid YAML{at}: {problem}", field=field, fix=fix) from None
    except RecursionError:
        raise SpecError(f"{where} nests too deeply", field=field, fix="write a flatter file") from None


def load_data_file(path: str | Path, field: str, what: str, fix: str) -> Any:
    """A YAML or JSON file, read and parsed with the checks above."""
    text = read_text(path, field, what)
    if str(path).endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise SpecError(f"{path} is not valid JSON ({e.msg} at line {e.lineno})", field=field, fix=fix) \
                from None
        except RecursionError:
            raise SpecError(f"{path} nests too deeply", field=field, fix="write a flatter file") from None
    return parse_yaml(text, str(path), field, fix)


__all__ = ["MAX_BYTES", "StrictLoader", "load_data_file", "parse_yaml", "read_text"]
