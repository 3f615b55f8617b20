"""Typed configuration: dataclasses loaded from YAML with dotted command-line overrides.

Every entrypoint declares its schema as a tree of dataclasses. `load_config(Schema, path, overrides)` reads
the YAML file, applies overrides such as ``train.steps=10 parallel.tp=2`` and validates types before any
work starts. Errors name the offending key and say how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import types
import typing
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and the fix."""


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert a YAML/CLI value to the declared type, or raise ConfigError naming the key."""
    tp, optional = _unwrap_optional(tp)
    if value is None:
        if optional or tp is Any:
            return None
        raise ConfigError(f"config key '{key}' may not be null; give a value of type {getattr(tp, '__name__', tp)}")
    if tp is Any:
        return value
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' is a section; give a mapping, not {value!r}")
        return _build(tp, value, key + ".")
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"config key '{key}' is {value!r}; choose one of {list(choices)}")
        return value
    if origin in (list, tuple, Sequence):
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.startswith("[") else [v for v in value.split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' must be a list, got {value!r}")
        items = [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}' must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if float(value).is_integer() else int(value)
            except ValueError:
                pass
        raise ConfigError(f"config key '{key}' must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"config key '{key}' must be a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"config key '{key}' must be a string, got {value!r}")
        return str(value)
    return value


def _build(cls: type, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for name, value in data.items():
        if name not in fields:
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else f"; valid keys: {sorted(fields)}"
            raise ConfigError(f"unknown config key '{prefix}{name}'{hint}")
        kwargs[name] = _coerce(value, hints[name], prefix + name)
    try:
        obj = cls(**kwargs)
    except ConfigError:
        raise
    except TypeError as e:
        raise ConfigError(f"config section '{prefix.rstrip('.') or cls.__name__}': {e}") from None
    return obj


def set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{p}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key=value, e.g. train.steps=10")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw != "" else ""
        out.append((key.strip(), value))
    return out


def to_dict(cfg: Any) -> Any:
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, (list, tuple)):
        return [to_dict(v) for v in cfg]
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return cfg


def from_dict(cls: type, data: dict):
    return _build(cls, data or {})


def load_config(cls: type, path: str | Path | None = None, overrides: Sequence[str] = ()):
    """Build `cls` from a YAML file (optional) plus dotted overrides, validating every key."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist; pass --config with a YAML file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file '{path}' is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file '{path}' must hold a mapping at top level")
    for key, value in parse_overrides(overrides):
        set_dotted(data, key, value)
    cfg = _build(cls, data)
    validate = getattr(cfg, "validate", None)
    if callable(validate):
        validate()
    return cfg


def save_config(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def describe_schema(cls: type, indent: int = 0) -> str:
    """Human-readable schema with defaults, used by the entrypoints' --help."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner, _ = _unwrap_optional(tp)
        pad = "  " * indent
        if _is_dataclass_type(inner):
            lines.append(f"{pad}{f.name}:")
            lines.append(describe_schema(inner, indent + 1))
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = f.default_factory()  # type: ignore[misc]
        else:
            default = "<required>"
        tname = getattr(inner, "__name__", None) or str(inner).replace("typing.", "")
        doc = (f.metadata or {}).get("help", "")
        lines.append(f"{pad}{f.name}: {default!r}  ({tname}){'  # ' + doc if doc else ''}")
    return "\n".join(lines)


def resolve_function(path: str) -> Callable:
    """Import ``package.module:function`` (or ``package.module.function``) and return the callable: how configs
    name the hooks they plug in (reward terms, advantage estimators, evaluation probes)."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"function path '{path}' must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"function path '{path}': cannot import module '{module_name}' ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"function path '{path}': module '{module_name}' has no function '{attr}'")
    return fn
