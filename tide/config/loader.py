"""Typed, frozen configuration loaded from YAML.

Every component reads one frozen dataclass section. Loading is strict: an unknown key, a wrong type
or a missing required value raises `ConfigError` with one line `FILE: key.path: what is wrong`
(with "did you mean ...?" for misspelled keys), so a bad config never starts a half-working job.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from tide.config.schema import TideConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration error; `str(e)` is the single line shown to the user."""


def load_config(path: str | Path, cls: type[T] = TideConfig) -> T:  # type: ignore[assignment]
    """Load and validate a YAML file into `cls`."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    return from_dict(cls, raw if raw is not None else {}, source=str(path))


def from_dict(cls: type[T], data: Any, source: str = "<dict>", prefix: str = "") -> T:
    """Build dataclass `cls` from plain data, checking keys and types recursively."""

    def fail(key_path: str | None, msg: str) -> typing.NoReturn:  # None: `msg` names its own fields
        line = f"{source}: {msg}" if key_path is None else f"{source}: {key_path or '<top>'}: {msg}"
        raise ConfigError(line.replace("\r", "\\r").replace("\n", "\\n"))  # one line, whatever the YAML held

    if not isinstance(data, dict):
        fail(prefix, f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs = {}
    for key, value in data.items():
        name = key if isinstance(key, str) and key.isprintable() else repr(key)
        key_path = f"{prefix}.{name}" if prefix else name
        if key not in fields:
            close = difflib.get_close_matches(str(key), fields, n=1)
            hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(fields)}"
            fail(key_path, f"unknown key; {hint}")
        kwargs[key] = _coerce(hints[key], value, key_path, fail, source)
    for name, f in fields.items():
        if name not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            fail(f"{prefix}.{name}" if prefix else name, "required value is missing")
    try:
        return cls(**kwargs)
    except ValueError as e:  # a section's own validation (__post_init__); the whole config's names its fields
        fail(prefix or None, str(e))


def _coerce(tp: Any, value: Any, key_path: str, fail: Any, source: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, source, key_path)
    if origin is Literal:
        if value not in typing.get_args(tp):
            fail(key_path, f"must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            if arm is type(None) and value is None:
                return None
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(arms) == 1:
            return _coerce(arms[0], value, key_path, fail, source)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            fail(key_path, f"expected a list, got {type(value).__name__}")
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        items = [_coerce(item_tp, v, f"{key_path}[{i}]", fail, source) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if tp is Any:
        return value
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp in (int, float, str, bool):
        if type(value) is not tp:
            fail(key_path, f"expected {tp.__name__}, got {type(value).__name__} {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            fail(key_path, f"expected a mapping, got {type(value).__name__}")
        return dict(value)
    raise TypeError(f"unsupported config type {tp!r} at {key_path}")  # a bug in the schema, not the file


def to_dict(cfg: Any) -> dict[str, Any]:
    """Plain-data form of a config (for JSON logs and for passing between processes)."""
    return dataclasses.asdict(cfg)
