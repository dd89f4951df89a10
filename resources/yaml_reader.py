"""Reading a resource or run file as untrusted input.

A run file may be corrupt, a wrong path (a dataset, a binary) or hostile. Whatever it holds,
reading it ends in the file's data or in one ResourceConfigError naming the file, where and
the fix; never in MemoryError, RecursionError, a bare UnicodeDecodeError or a long hang.
Each limit is far above any real run file (a few hundred bytes, four levels deep):

- MAX_BYTES: only this much is read, so a path to a 50 GB dataset cannot fill memory.
- MAX_DEPTH: PyYAML composes nested values recursively, so `[[[[...` 10000 deep would
  end in RecursionError; deeper files are refused while composing.
- MAX_VALUES: values, as written (1 MiB of `[1,1,1,...` takes 15 s to compose; 10k values
  take 0.3 s) and once anchors and aliases are expanded. PyYAML shares an aliased value
  instead of copying it, so loading a "billion laughs" file is cheap, but anything that
  walks the result (validation, error messages, pickling to workers) takes 10**9 steps;
  it is refused before construction. An alias inside its own anchor (a cycle) is refused
  too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from resources.config import ResourceConfigError

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_VALUES", "read_yaml"]

MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 10_000


class _Refused(yaml.MarkedYAMLError):
    """A file over one of the limits, with its own fix; a MarkedYAMLError so that PyYAML
    lets it through unchanged and its mark gives the line."""

    def __init__(self, problem: str, mark, fix: str):
        super().__init__(problem=problem, problem_mark=mark)
        self.fix = fix


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader (no Python objects) that refuses duplicate keys, deep nesting, alias
    expansion past MAX_VALUES and recursive aliases; plain YAML keeps a duplicate's last
    value silently."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = self._values = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark,
                           "flatten the file: a run file needs only a few levels")
        self._values += 1  # counted as they come: pure-Python YAML builds ~40k values a second
        if self._values > MAX_VALUES:
            raise _Refused(f"more than {MAX_VALUES} values", self.peek_event().start_mark,
                           "move long lists (such as prompts) into a file of their own")
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def fetch_flow_collection_start(self, TokenClass):
        # The same limit, met earlier: the scanner reads up to 1024 characters ahead inside
        # `[[[[`, in time quadratic in the depth, before the composer sees the first level.
        if self.flow_level >= MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.get_mark(),
                           "flatten the file: a run file needs only a few levels")
        super().fetch_flow_collection_start(TokenClass)

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)  # on the node graph, before any value is built
        return node

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` may be overridden by later keys on purpose
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float)):
                continue  # an unhashable key: SafeLoader reports it itself
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return []


def _check_expansion(root: yaml.Node | None) -> None:
    """Refuse a document whose aliases expand past MAX_VALUES values or MAX_DEPTH levels,
    or loop. An iterative post-order walk, each node once: it costs the file's size, not
    the expansion's, and cannot itself run out of stack."""
    done: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) once expanded
    open_nodes: set[int] = set()  # on the current path: meeting one again is a cycle
    stack = [(root, False)] if root is not None else []
    while stack:
        node, kids_done = stack.pop()
        if id(node) in done:
            continue
        kids = _children(node)
        if not kids_done:
            if id(node) in open_nodes:
                raise _Refused("an alias refers to the value that contains it", node.start_mark,
                               "point each alias at a value defined before it, outside it")
            open_nodes.add(id(node))
            stack.append((node, True))
            stack.extend((kid, False) for kid in reversed(kids))
            continue
        open_nodes.discard(id(node))
        values = 1 + sum(done[id(kid)][0] for kid in kids)
        depth = 1 + max((done[id(kid)][1] for kid in kids), default=0)
        if values > MAX_VALUES or depth > MAX_DEPTH:
            what = (f"more than {MAX_VALUES} values" if values > MAX_VALUES
                    else f"deeper than {MAX_DEPTH} levels")
            raise _Refused(f"anchors and aliases expand to {what}", node.start_mark,
                           "write the values out, or alias a value only a few times")
        done[id(node)] = (values, depth)


def read_yaml(path: Path, name: str) -> Any:
    """The data of the YAML file at `path`; errors name it as `name` (as the user wrote it)."""
    if not path.is_file():
        problem = "is a directory" if path.is_dir() else "file not found"
        raise ResourceConfigError(name, "", None, problem, f"check the path ({path.resolve()})")
    with path.open("rb") as file:
        raw = file.read(MAX_BYTES + 1)  # no more: the file may be huge or still growing
    if len(raw) > MAX_BYTES:
        raise ResourceConfigError(name, "", None, f"larger than {MAX_BYTES >> 20} MiB, too big for "
                                  "a run file", "check the path points at the YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ResourceConfigError(name, f"line {line}", None, f"not UTF-8 text (byte "
                                  f"0x{raw[exc.start]:02x} at offset {exc.start})",
                                  "save the file as UTF-8, and check the path points at the "
                                  "YAML file") from None
    return _load(text, name)


def _load(text: str, name: str) -> Any:
    try:
        return yaml.load(text, Loader=_StrictLoader)
    except yaml.reader.ReaderError as exc:  # a control character: usually a binary file
        line = text.count("\n", 0, exc.position) + 1
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        raise ResourceConfigError(name, f"line {line}", None, f"character #x{code:04x} "
                                  "is not allowed in YAML", "check the path points at the YAML "
                                  "file, and remove control characters") from None
    except _Refused as exc:
        mark = exc.problem_mark
        raise ResourceConfigError(name, f"line {mark.line + 1}, column {mark.column + 1}", None,
                                  exc.problem, exc.fix) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if problem.startswith("duplicate key"):
            fix = "write each key once"
        elif problem.startswith("could not determine a constructor"):  # !!python/object, ...
            fix = "remove the tag: a run file holds plain values only"
        else:
            fix = "correct the YAML there (indentation, a missing ':' or an unclosed bracket)"
        raise ResourceConfigError(name, where, None, f"invalid YAML ({problem})", fix) from None
    except (ValueError, OverflowError) as exc:
        # A scalar YAML matched but Python cannot build: an int past Python's 4300-digit
        # limit, or a date like 2024-13-45.
        raise ResourceConfigError(name, "", None, f"a value YAML cannot convert ({exc})",
                                  "quote the value to keep it as text, or correct it") from None
