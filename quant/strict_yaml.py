"""Strict, bounded YAML for the files users hand us (recipes, calibration manifests, ``--set`` values).

PyYAML's safe loader is safe from code execution but not from everything else: dates, ``!!binary`` and ``!!set``
become Python objects nothing downstream expects, duplicate keys silently keep the last value, deep nesting
overflows the recursion limit and a few aliases ("billion laughs") expand to billions of values. Here:

- only plain data: strings, integers (64-bit), finite-or-not floats, booleans, null, lists and string-keyed
  mappings; any other tag (``!!binary``, ``!!set``, ``!!timestamp``, ``!!python/...``, ``!local``) is an error,
  and an unquoted date stays a string (as in YAML 1.2's core schema);
- duplicate keys are an error; nesting deeper than ``MAX_DEPTH`` is refused while composing, before Python's
  recursion limit is near; aliases are allowed, but the number of values they expand to is counted on the
  composed graph (shared nodes, nothing expanded yet) and more than ``MAX_VALUES`` is refused;
- text must be UTF-8 without control characters, at most ``MAX_BYTES``.

Every problem raises ``error_type(message)`` with one line naming where it is.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

MAX_BYTES = 1 << 20
MAX_DEPTH = 16
MAX_VALUES = 10_000
_TAG = "tag:yaml.org,2002:"
_PLAIN_TAGS = {_TAG + t for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")}
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


class _Loader(yaml.SafeLoader):
    """Safe loader without timestamp resolution whose composer refuses nesting deeper than ``MAX_DEPTH``."""

    depth = 0
    error_type: type[Exception] = ValueError

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise self.error_type(f"nesting deeper than {MAX_DEPTH} levels at line {mark.line + 1}")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _TAG + "timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _count(node: Node, err: type[Exception], memo: dict[int, int], open_: set[int]) -> int:
    """Values ``node`` expands to (aliases counted at every use); checks tags and duplicate keys once per node."""
    if id(node) in memo:
        return memo[id(node)]
    if id(node) in open_:
        raise err(f"recursive YAML alias at line {_line(node)}")
    if node.tag not in _PLAIN_TAGS:
        tag = node.tag.replace(_TAG, "!!")
        raise err(f"unsupported YAML tag '{tag}' at line {_line(node)}: only strings, numbers, booleans, null, "
                  "lists and mappings are accepted (quote the value to make it a string)")
    open_.add(id(node))
    n = 1
    if isinstance(node, SequenceNode):
        n += sum(_count(child, err, memo, open_) for child in node.value)
    elif isinstance(node, MappingNode):
        seen: dict[tuple[str, str], int] = {}
        for key, value in node.value:
            if isinstance(key, ScalarNode) and key.tag != _TAG + "merge":
                if (key.tag, key.value) in seen:
                    raise err(f"duplicate key '{key.value}' at line {_line(key)} (first at line "
                              f"{seen[(key.tag, key.value)]})")
                seen[(key.tag, key.value)] = _line(key)
            n += _count(key, err, memo, open_) + _count(value, err, memo, open_)
    open_.discard(id(node))
    memo[id(node)] = n
    if n > MAX_VALUES:
        raise err(f"the document expands to more than {MAX_VALUES} values (YAML aliases at line {_line(node)}); "
                  "write the values out")
    return n


def _problem(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.reader.ReaderError):
        char = e.character if isinstance(e.character, int) else ord(e.character)
        return f"unacceptable character #x{char:04x} at position {e.position}"
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
    return f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}{where}"


def check_text(text: str, what: str, err: type[Exception]) -> None:
    """Refuse control characters (other than tab / newline / carriage return) and lone surrogates."""
    bad = _CONTROL.search(text)
    if bad:
        char = bad.group()
        desc = (f"the unpaired surrogate U+{ord(char):04X} (for characters beyond U+FFFF write the character or "
                "\\U00XXXXXX)" if "\ud800" <= char <= "\udfff" else f"the control character {char!r}")
        raise err(f"{what} holds {desc} at position {bad.start()}")


def decode(raw: bytes, what: str, err: type[Exception]) -> str:
    """UTF-8 text of a file's bytes, or ``err`` naming the first invalid byte."""
    if len(raw) > MAX_BYTES:
        raise err(f"{what} is {len(raw)} bytes; at most {MAX_BYTES} are accepted")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise err(f"{what} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def plain(value: Any, where: str, err: type[Exception], root: str = "the document") -> Any:
    """Deep copy of loaded data, checking that it holds only plain values (string keys, 64-bit integers,
    strings without control characters). ``where``: the dotted path so far; ``root``: what the document is, named in
    messages about the document itself (a ``--set`` value's key)."""
    name = f"'{where}'" if where else root
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise err(f"key {k!r} in {name} is not a string")
            check_text(k, f"a key in {name}", err)
            out[k] = plain(v, f"{where}.{k}" if where else k, err, root)
        return out
    if isinstance(value, list):
        return [plain(v, f"{where or root}[{i}]", err, root) for i, v in enumerate(value)]
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return value
    if isinstance(value, int):
        if not -(2**63) <= value < 2**63:
            raise err(f"{name}: integer {value} does not fit in 64 bits")
        return value
    if isinstance(value, str):
        check_text(value, f"the value of {name}", err)
        return value
    raise err(f"{name} holds a {type(value).__name__}, not a plain value")


def load(text: str, what: str, err: type[Exception]) -> Any:
    """Parse one YAML document strictly (see the module docstring); ``what`` names it in messages."""
    check_text(text, what, err)
    loader = _Loader(text)
    loader.error_type = err
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _count(node, err, {}, set())
        data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise err(f"malformed YAML in {what}: {_problem(e)}") from None
    finally:
        loader.dispose()
    return plain(data, "", err, what)
