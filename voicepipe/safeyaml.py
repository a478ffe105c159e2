"""A restricted YAML reader for files and values a user gives us.

Contract: :func:`load` turns YAML text into plain data — ``dict`` (text keys), ``list``, ``str``, ``int``,
``float`` (finite), ``bool``, ``None`` — or raises :class:`YamlRejected` with a one-line reason and, where
known, the line. Refused:

* any tag outside the YAML core types (``!!python/object``, ``!!binary``, ``!!set``, custom ``!tags``);
* duplicate keys in one mapping, and keys that are not text (``1:``, ``[a]:``, ``yes:``);
* ``.inf`` / ``.nan``;
* integers longer than Python converts (4,300 digits);
* documents with more than :data:`~voicepipe.limits.MAX_YAML_VALUES` values once aliases are expanded
  (alias bombs) or nested deeper than :data:`~voicepipe.limits.MAX_YAML_DEPTH` (recursive aliases too).

Dates stay text (no implicit timestamps), and YAML 1.2 exponent floats (``1e3``) are floats as a user
means them. libyaml's parser is used when PyYAML has it (about 8x faster); the checks are the same either
way. The caller bounds the text's size before it gets here (:func:`voicepipe.files.read_text`).
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import yaml

from voicepipe.limits import MAX_YAML_DEPTH, MAX_YAML_VALUES

_Base: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

_CORE = "tag:yaml.org,2002:"
_ALLOWED = {f"{_CORE}{t}" for t in ("null", "bool", "int", "float", "str", "seq", "map")}
_MERGE = f"{_CORE}merge"
# YAML 1.2 core schema floats without a dot (1e3, -2.5E-3 is already a YAML 1.1 float)
_EXP_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")


class YamlRejected(ValueError):
    """Why a YAML text was refused (one line), and the 1-based line when known."""

    def __init__(self, msg: str, line: int | None = None) -> None:
        self.line = line
        super().__init__(f"line {line}: {msg}" if line else msg)


def _line(node: yaml.Node) -> int | None:
    mark = getattr(node, "start_mark", None)
    return mark.line + 1 if mark is not None else None


class _Loader(_Base):
    yaml_constructors: ClassVar = {tag: fn for tag, fn in _Base.yaml_constructors.items() if tag in _ALLOWED}
    yaml_implicit_resolvers: ClassVar = {
        first: [(tag, rx) for tag, rx in rules if tag != f"{_CORE}timestamp"]
        for first, rules in _Base.yaml_implicit_resolvers.items()
    }

    def construct_undefined(self, node: yaml.Node) -> Any:
        tag = str(node.tag).replace(_CORE, "!!")
        raise YamlRejected(f"tag {tag} is not allowed (plain values, lists and mappings only)", _line(node))

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise YamlRejected("integer has too many digits", _line(node)) from None

    def construct_yaml_float(self, node: yaml.ScalarNode) -> float:
        value = super().construct_yaml_float(node)
        if not math.isfinite(value):
            raise YamlRejected(f"{node.value!r} is not a finite number", _line(node))
        return value

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int | None] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                if not isinstance(key_node, yaml.ScalarNode):
                    raise YamlRejected("a key must be plain text, not a list or mapping", _line(key_node))
                key = self.construct_object(key_node)
                if not isinstance(key, str):
                    raise YamlRejected(f"key {key!r} is not text (quote it)", _line(key_node))
                if key in first:
                    raise YamlRejected(f"duplicate key {key!r} (first on line {first[key]})", _line(key_node))
                first[key] = _line(key_node)
        return super().construct_mapping(node, deep)


_Loader.add_constructor(None, _Loader.construct_undefined)
_Loader.add_constructor(f"{_CORE}int", _Loader.construct_yaml_int)
_Loader.add_constructor(f"{_CORE}float", _Loader.construct_yaml_float)
_Loader.add_constructor(f"{_CORE}map", _Loader.construct_yaml_map)
_Loader.add_implicit_resolver(f"{_CORE}float", _EXP_FLOAT, list("-+0123456789"))


def _check_size(data: Any) -> None:
    """Count values as a consumer would see them (each alias expanded) and the nesting depth."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        obj, depth = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise YamlRejected(f"more than {MAX_YAML_VALUES:,} values once aliases are expanded")
        if depth > MAX_YAML_DEPTH:
            raise YamlRejected(f"nested deeper than {MAX_YAML_DEPTH} levels")
        if isinstance(obj, dict):
            stack.extend((v, depth + 1) for v in obj.values())
        elif isinstance(obj, list):
            stack.extend((v, depth + 1) for v in obj)


def load(text: str) -> Any:
    """Plain data from one YAML document (see the module docstring), or :class:`YamlRejected`."""
    loader = _Loader(text)
    try:
        data = loader.get_single_data()
    except YamlRejected:
        raise
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        why = exc.problem or exc.context or "syntax error"
        raise YamlRejected(f"invalid YAML ({why})", mark.line + 1 if mark else None) from None
    except yaml.YAMLError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise YamlRejected(f"invalid YAML ({first})") from None
    except RecursionError:
        raise YamlRejected(f"nested deeper than {MAX_YAML_DEPTH} levels") from None
    finally:
        loader.dispose()
    _check_size(data)
    return data
