"""Settings declared once: each field of a process's config dataclass carries its help, its variable, its flag and
its check, and from them come the command line, the reading of the environment, the checks and the reference.

A config is a frozen dataclass whose fields are made by `setting(default, help, ...)`; it names the prefix of
its variables in `ENV_PREFIX` (a field's variable is the prefix and its name in capitals, unless it says
otherwise) and calls `check(self)` in `__post_init__`. A field made by `nested(Config)` holds another config
whose settings belong to the same process (the worker's engine and request limits).

- `add_flags(parser, Config)` adds a flag per setting that has one; a flag not given leaves no value, so that
  `build` can tell it from one given as its default.
- `build(Config, args, environ)`: defaults, then variables, then flags (then explicit overrides); a value that
  does not parse or fails its check raises `SettingError` naming the flag or the variable it came from.
- `to_json` / `from_json`: a config handed to a process it starts (a worker, `serve`'s broker).
- `entries(Config)`: every setting with its flag, variables, default and help, for `--help` and the generated
  reference (`scripts/config_reference.py`).

Shared by the broker, the workers and their command lines, as `broker.protocol` is; imports only the stdlib.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

# Every component's CURVE key directory (`broker.curve`): one variable for the broker, the workers and the trainer.
CURVE_KEYS_ENV = "ROLLOUT_GATEWAY_CURVE_KEYS"

_SETTING = "setting"
_NESTED = "nested"
# A switch's variable turns it off with one of these (any other value turns it on).
OFF_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A setting's value that does not parse or fails its check; the message names where it came from."""


@dataclass(frozen=True)
class Setting:
    """What a config field declares besides its default.

    Args:
        help: what it does, for `--help` and the reference.
        flag: its flag: "" derives `--field-name`; None: set only by its variable (and by `build`'s overrides).
        env: its variables: "" derives ENV_PREFIX + NAME; None: none; else the names, the first one set wins.
        metavar: the flag's value in `--help`.
        choices: the values it may take (a `Literal` type says them too); checked.
        check: the problem with a value ("must be > 0"), or None when it is fine.
        shown: the default as people read it ("2 GiB"), where its repr is not.
    """

    help: str
    flag: str | None = ""
    env: str | tuple[str, ...] | None = ""
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    shown: str | None = None

    def problem(self, value: Any, choices: tuple[str, ...] | None) -> str | None:
        if choices is not None and value not in choices:
            return f"must be one of {', '.join(choices[:-1])} or {choices[-1]}"
        return self.check(value) if self.check is not None else None


def setting(default: Any, help: str, **declared: Any) -> Any:
    """A config field with its default and its `Setting`."""
    return dataclasses.field(default=default, metadata={_SETTING: Setting(help, **declared)})


def nested(config: type) -> Any:
    """A config field holding another config of the same process (its settings are this one's)."""
    return dataclasses.field(default_factory=config, metadata={_NESTED: True})


# --- checks -----------------------------------------------------------------------------------


def positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "must be positive (> 0)"


def not_negative(value: Any) -> str | None:
    return None if value >= 0 else "must be >= 0"  # `not >=` would pass NaN: this fails it


# --- what a config declares ---------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One setting of a config (of a nested one too): where it sits, how it is set, what it does."""

    config: type  # the class that declares it
    path: tuple[str, ...]  # field names from the outermost config: ("engine", "kind")
    setting: Setting
    default: Any
    hint: Any  # the field's type
    envs: tuple[str, ...]
    flag: str | None

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def dest(self) -> str:
        """Its value's name in an argparse namespace: the outermost config's too, so two configs sharing a parser
        (serve's worker and broker) never take each other's flags."""
        return ".".join(self.path)

    @property
    def choices(self) -> tuple[str, ...] | None:
        return self.setting.choices or _literal(self.hint)

    def problem(self, value: Any) -> str | None:
        return self.setting.problem(value, self.choices)

    @property
    def switch(self) -> bool:
        return _base(self.hint) is bool

    @property
    def many(self) -> bool:
        return typing.get_origin(_base(self.hint)) is tuple

    def parse(self, text: str) -> Any:
        """A value from its text (a variable's, a flag's)."""
        base, optional = _base(self.hint), _optional(self.hint)
        if optional and (text == "" or (base is int and text.strip().lower() == "none")):
            return None
        if base is bool:
            return text.strip().lower() not in OFF_WORDS
        if typing.get_origin(base) is tuple:
            return tuple(part for part in text.replace(",", " ").split() if part)
        if base in (int, float):
            return base(text)
        return text

    def shown_default(self) -> str:
        if self.setting.shown is not None:
            return self.setting.shown
        if self.default is None or self.default == ():
            return "none"
        if isinstance(self.default, bool):
            return "on" if self.default else "off"
        return str(self.default)


@cache
def entries(config: type, _path: tuple[str, ...] = ()) -> tuple[Entry, ...]:
    """Every setting of `config`, nested configs' included, in declaration order."""
    hints = typing.get_type_hints(config)
    found: list[Entry] = []
    for field in dataclasses.fields(config):
        path = (*_path, field.name)
        if field.metadata.get(_NESTED):
            found.extend(entries(hints[field.name], path))
            continue
        declared = field.metadata.get(_SETTING)
        if declared is None:
            continue
        if declared.env is None:
            envs: tuple[str, ...] = ()
        elif declared.env == "":
            envs = (config.ENV_PREFIX + field.name.upper(),)  # type: ignore[attr-defined]
        else:
            envs = (declared.env,) if isinstance(declared.env, str) else declared.env
        flag = "--" + field.name.replace("_", "-") if declared.flag == "" else declared.flag
        found.append(Entry(config, path, declared, field.default, hints[field.name], envs, flag))
    return tuple(found)


def check(config: Any) -> None:
    """Each of `config`'s own settings (not its nested configs': they check themselves) against its check."""
    for entry in entries(config.__class__):
        if len(entry.path) == 1:
            value = getattr(config, entry.name)
            problem = entry.problem(value)
            if problem is not None:
                raise SettingError(f"{type(config).__name__}.{entry.name} {problem}, got {value!r}")


# --- the command line ---------------------------------------------------------------------------


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: type, *, within: str = "",
    skip: Sequence[str] = (), defaults: Mapping[str, Any] | None = None,
) -> None:
    """A flag per setting of `config` that has one: of those under `within` (a nested config's dotted path, or ""
    for all), but those under `skip` (dotted paths: "worker.tokenizer", or a nested config's: "worker");
    `defaults` (by dotted path) are this command's own defaults (see `build`)."""
    defaults = defaults or {}
    for entry in entries(config):
        if entry.flag is None or not _under(entry.dest, (within,) if within else ("",)) or _under(entry.dest, skip):
            continue
        where = [f"default {defaults[entry.dest]}" if entry.dest in defaults else f"default {entry.shown_default()}"]
        if entry.envs:
            where.append("env " + ", ".join(entry.envs))
        help_text = f"{entry.setting.help} ({'; '.join(where)})".replace("`", "").replace("%", "%%")
        options: dict[str, Any] = {"dest": entry.dest, "default": argparse.SUPPRESS, "help": help_text}
        if entry.switch:
            options["action"] = "store_true"
        elif entry.choices is not None:
            options["choices"] = entry.choices
        else:
            options["metavar"] = entry.setting.metavar
            options["type"] = _flag_type(entry)
            if entry.many:
                options["action"] = "append"
        action = parser.add_argument(entry.flag, **options)
        action.setting_entry = entry  # type: ignore[attr-defined]  # for the reference: which setting it sets


def _under(dest: str, paths: Sequence[str]) -> bool:
    return any(path == "" or dest == path or dest.startswith(path + ".") for path in paths)


def _flag_type(entry: Entry) -> Callable[[str], Any]:
    base = _base(entry.hint)
    if typing.get_origin(base) is tuple:
        return str  # one item per flag (`append`)
    parse = entry.parse
    name = base.__name__ if isinstance(base, type) else "value"

    def flag_value(text: str) -> Any:
        return parse(text)

    flag_value.__name__ = name  # argparse's "invalid int value: 'x'"
    return flag_value


# --- building a config ----------------------------------------------------------------------------


def build(
    config: type, args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None, *,
    defaults: Mapping[str, Any] | None = None, **overrides: Any,
) -> Any:
    """`config` from its defaults (`defaults`, by dotted path, replace the declared ones: a command's own), then its
    variables in `environ` (default: os.environ), then the flags given in `args`, then `overrides` (fields of the
    outermost config; a nested config's as a dict of its own). Raises `SettingError` naming the flag or the
    variable of a value that does not parse or fails its check."""
    env = os.environ if environ is None else environ
    values: dict[tuple[str, ...], Any] = {}
    for entry in entries(config):
        source, value = None, None
        if defaults and entry.dest in defaults:
            source, value = "default", defaults[entry.dest]
        for name in entry.envs:
            if name in env:
                text = env[name]
                source = f"environment variable {name}={text!r}"
                value = _parsed(entry, text, source)
                break
        if args is not None and hasattr(args, entry.dest):
            source, value = entry.flag, getattr(args, entry.dest)
            if entry.many:
                value = tuple(value)
        if source is None:
            continue
        problem = entry.problem(value)
        if problem is not None:
            raise SettingError(f"{source}: {entry.dest} {problem}, got {value!r}")
        values[entry.path] = value
    return _assemble(config, values, (), overrides)


def _parsed(entry: Entry, text: str, source: str) -> Any:
    try:
        return entry.parse(text)
    except ValueError as e:
        raise SettingError(f"{source}: {e}") from None


def _assemble(
    config: type, values: dict[tuple[str, ...], Any], path: tuple[str, ...], overrides: dict[str, Any]
) -> Any:
    hints = typing.get_type_hints(config)
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(config):
        here = (*path, field.name)
        if field.metadata.get(_NESTED):
            kwargs[field.name] = _assemble(hints[field.name], values, here, overrides.get(field.name) or {})
        elif here in values:
            kwargs[field.name] = values[here]
        if field.name in overrides and not field.metadata.get(_NESTED):
            kwargs[field.name] = overrides[field.name]
    try:
        return config(**kwargs)
    except SettingError:
        raise
    except (TypeError, ValueError) as e:
        raise SettingError(str(e)) from e


# --- handing a config to another process ---------------------------------------------------------


def to_json(config: Any) -> str:
    return json.dumps(dataclasses.asdict(config))


def from_json(config: type, text: str) -> Any:
    """The config `to_json` wrote (lists back into tuples, nested configs rebuilt); ValueError if it is none."""
    try:
        return _from_plain(config, json.loads(text))
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"not a valid {config.__name__}: {e}") from e


def _from_plain(config: type, values: dict[str, Any]) -> Any:
    hints = typing.get_type_hints(config)
    kwargs = dict(values)
    for field in dataclasses.fields(config):
        if field.name not in kwargs:
            continue
        if field.metadata.get(_NESTED):
            kwargs[field.name] = _from_plain(hints[field.name], kwargs[field.name])
        elif typing.get_origin(_base(hints[field.name])) is tuple:
            kwargs[field.name] = tuple(kwargs[field.name])
    return config(**kwargs)


# --- types ----------------------------------------------------------------------------------------


def _optional(hint: Any) -> bool:
    return _is_union(hint) and type(None) in typing.get_args(hint)


def _base(hint: Any) -> Any:
    """`hint` without None."""
    if _is_union(hint):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _literal(hint: Any) -> tuple[str, ...] | None:
    base = _base(hint)
    return tuple(typing.get_args(base)) if typing.get_origin(base) is Literal else None
