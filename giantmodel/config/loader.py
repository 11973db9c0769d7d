"""Strict YAML -> dataclass loading, dotted overrides and config dumps.

Every key is checked against the dataclass schema before anything is built:
an unknown key names the closest valid one, a wrong type names the expected
type. Overrides (``train.steps=100``) are parsed as YAML scalars and applied
to the raw mapping, so they go through exactly the same checks as the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from giantmodel.config.errors import ConfigError


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(tp))}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against type ``tp`` and return it converted."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"expected a mapping of {tp.__name__} fields, got "
                              f"{type(value).__name__} {value!r}", key)
        return from_dict(tp, value, prefix=key)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"must be one of {_type_name(tp)}, got {value!r}", key)
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"must not be null (expected {_type_name(tp)})", key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"expected {_type_name(tp)}, got {type(value).__name__} {value!r}", key)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"expected a list, got {type(value).__name__} {value!r}", key)
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_convert(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"expected a mapping, got {type(value).__name__}", key)
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"expected true or false, got {value!r}", key)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"expected an integer, got {type(value).__name__} {value!r}", key)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"expected a number, got {type(value).__name__} {value!r}", key)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"expected a string, got {type(value).__name__} {value!r}", key)
        return value
    raise TypeError(f"unsupported config type {tp!r} at {key}")


def _unknown_key(cls: type, name: str, prefix: str) -> ConfigError:
    valid = [f.name for f in dataclasses.fields(cls)]
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{_join(prefix, close[0])}'?" if close else ""
    return ConfigError(f"unknown key{hint}. Valid keys here: {', '.join(valid)}",
                       _join(prefix, name))


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def from_dict(cls: type, data: dict, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a mapping, refusing unknown keys."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        if name not in names:
            raise _unknown_key(cls, str(name), prefix)
        kwargs[name] = _convert(value, hints[name], _join(prefix, name))
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """A plain, YAML-safe mapping of a (nested) config dataclass."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"optim.lr=3e-4"`` -> (["optim", "lr"], 3e-4)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like KEY=VALUE, e.g. train.steps=100")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key part")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"cannot parse value {raw!r}: {e}", key) from None
    # YAML 1.1 reads "1e-4" as a string; users mean a number.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value for c in ".eE") else value
        except ValueError:
            pass
    return key.split("."), value


def apply_overrides(raw: dict, overrides: list[str], schema: type) -> dict:
    """Set each dotted override inside ``raw``, checking the path exists in ``schema``."""
    for text in overrides:
        path, value = parse_override(text)
        node, cls = raw, schema
        for i, part in enumerate(path):
            fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
            if dataclasses.is_dataclass(cls) and part not in fields:
                raise _unknown_key(cls, part, ".".join(path[:i]))
            if i == len(path) - 1:
                node[part] = value
                break
            hint = typing.get_type_hints(cls).get(part)
            # Optional[Dataclass] sections: descend into the dataclass member.
            for arg in typing.get_args(hint) or (hint,):
                if dataclasses.is_dataclass(arg):
                    hint = arg
            if not dataclasses.is_dataclass(hint):
                raise ConfigError(f"'{part}' is a value, not a section", ".".join(path[: i + 1]))
            sub = node.get(part)
            if not isinstance(sub, dict):
                sub = node[part] = {}
            node, cls = sub, hint
    return raw


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist; pass an existing "
                          "YAML file to --config, or omit it for the built-in default")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal under each field)."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs
