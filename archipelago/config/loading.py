"""Turn a TOML file plus `--section.key value` arguments into a validated `Config`.

The TOML file is read strictly by our own small converter (so its errors can name
the file and the closest valid key); the command line is parsed by tyro, with the
TOML result as defaults, so `--help` shows the values the file set.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomllib

from archipelago.config.errors import ConfigError
from archipelago.config.schema import Config
from archipelago.config.torchtitan import convert, is_torchtitan

log = logging.getLogger("archipelago.config")


def closest(name: str, choices: typing.Iterable[str]) -> str | None:
    """The valid name closest to `name`, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.5)
    return matches[0] if matches else None


def _unknown(kind: str, name: str, choices: typing.Iterable[str], where: str) -> ConfigError:
    choices = list(choices)
    hint = closest(name, choices)
    suggestion = f"did you mean `{hint}`? " if hint else ""
    return ConfigError(f"{where}: unknown {kind} `{name}`; {suggestion}valid: {', '.join(choices)}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "unset"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check `value` (as TOML parsed it) against the annotation `tp`; ints widen to floats."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif isinstance(tp, types.UnionType) or origin is typing.Union:
        for arm in typing.get_args(tp):
            if arm is type(None):
                continue
            try:
                return _coerce(value, arm, where)
            except ConfigError:
                pass
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema field of a type this converter does not know
        raise TypeError(f"config field {where} has unsupported type {tp!r}")
    raise ConfigError(f"{where} = {value!r}: expected {_type_name(tp)}, got {type(value).__name__}")


def _section_from_table(cls: type, table: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in table.items():
        if key not in hints:
            raise _unknown("key", key, names, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def section_from_table(cls: type, table: Any, where: str) -> Any:
    """One dataclass section from a TOML table, refusing unknown or mistyped keys (the
    run files' rules, for other files such as simulation scenarios)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table, not a {type(table).__name__}")
    return _section_from_table(cls, table, where)


def config_from_dict(raw: dict[str, Any], source: str = "config") -> Config:
    """Build a Config from a parsed TOML document, refusing unknown or mistyped keys."""
    hints = typing.get_type_hints(Config)
    sections = {}
    for name, table in raw.items():
        if name not in hints:
            raise _unknown("section", f"[{name}]", [f"[{s}]" for s in hints], source)
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: `{name}` must be a [{name}] table, not a {type(table).__name__}")
        sections[name] = _section_from_table(hints[name], table, f"{source}: {name}")
    return Config(**sections)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file's document (ConfigError naming the file when it is missing or not TOML)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; shipped configs live under configs/")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def load_toml(path: str | Path) -> Config:
    """Read one TOML run file into a Config (without validation). A file in torchtitan's
    format is mapped onto ours first (config/torchtitan.py), its left-out keys logged."""
    raw = read_toml(path)
    if is_torchtitan(raw):
        conversion = convert(raw, str(path))
        if conversion.warning(str(path)):
            log.warning("%s", conversion.warning(str(path)))
        raw = conversion.ours
    return config_from_dict(raw, str(path))


def split_config_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull `--config PATH` / `--config=PATH` (or $CONFIG_FILE) out of argv."""
    rest: list[str] = []
    path = None
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a path, e.g. --config configs/llama3/debug.toml")
            path = argv[i + 1]
            i += 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path or os.environ.get("CONFIG_FILE") or None, rest


def parse_overrides(base: Config, argv: list[str], prog: str = "archipelago train",
                    description: str | None = None) -> Config:
    """Apply `--section.key value` overrides on top of `base` (tyro prints help and errors)."""
    import tyro  # imported here: tyro is slow to import and only the CLI needs it

    return tyro.cli(Config, default=base, args=argv, prog=prog, description=description,
                    use_underscores=True)


def load_config(argv: list[str], prog: str = "archipelago train",
                description: str | None = None, validated: bool = True) -> Config:
    """The whole path from command line to a Config, validated unless `validated` is False
    (a launcher reading one setting of the config its islands will check themselves)."""
    from archipelago.config.validate import validate

    path, rest = split_config_flag(argv)
    base = load_toml(path) if path else Config()
    cfg = parse_overrides(base, rest, prog=prog, description=description)
    if validated:
        validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """Plain nested dict of a Config (for config.json in the run directory)."""
    return dataclasses.asdict(cfg)


def load_run_config(path: str | Path) -> Config:
    """The Config a run wrote to RUN_DIR/config.json (`config_to_dict`; its nulls are unset
    keys, which TOML has no word for)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable run config ({exc})") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: not a run config (a JSON object of sections)")
    tables = {name: {k: v for k, v in table.items() if v is not None} if isinstance(table, dict) else table
              for name, table in raw.items()}
    return config_from_dict(tables, str(path))
