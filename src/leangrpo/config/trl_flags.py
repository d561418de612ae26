"""TRL's command-line flags on `leangrpo train`: `--learning_rate 1e-5`, `--learning_rate=1e-5`,
`--reward_funcs a b` and a bare `--use_peft` (true), as `trl grpo` takes them, beside leangrpo's
`section.key=value` overrides. They join a flat TRL config (or make one without `-c`) before it is
translated, so that a flag means what it means to TRL; on leangrpo's nested config, a flag that is a plain
field's other name sets that field."""

from __future__ import annotations

import re
import typing
from typing import Any

import yaml

from leangrpo.config.schema import ConfigError
from leangrpo.config.trl import _TRANSLATED, _mapped, is_trl_config
from leangrpo.config.trl_fields import TRL_TYPES

_OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")
"""A leangrpo override (`grpo.beta=0.1`): it ends the values of the flag before it."""

_LIST_FLAGS = {"reward_funcs", "lora_target_modules", "lora_modules_to_save"} | {
    name
    for name, kind in TRL_TYPES.items()
    if typing.get_origin(kind) is list
    or (str not in typing.get_args(kind) and any(typing.get_origin(k) is list for k in typing.get_args(kind)))
}
"""Flags that `trl grpo` reads as a list (`nargs="+"`) even with one value."""


def split_flags(args: list[str]) -> tuple[dict[str, Any], list[str]]:
    """TRL's `--flag value...` items of a command line, by field name, apart from the `section.key=value`
    overrides, in order."""
    flags: dict[str, Any] = {}
    rest: list[str] = []
    i = 0
    while i < len(args):
        item = args[i]
        i += 1
        if not item.startswith("--"):
            rest.append(item)
            continue
        name, has_value, raw = item[2:].partition("=")
        name = name.replace("-", "_")
        if not name.isidentifier():
            raise ConfigError(f"command line: {item!r} is neither TRL's --name value nor section.key=value")
        values = [raw] if has_value else []
        while not has_value and i < len(args) and not _ends_values(args[i]):
            values.append(args[i])
            i += 1
        flags[name] = _value(name, values)
    return flags, rest


def _ends_values(item: str) -> bool:
    """The next flag, or a leangrpo override, ends a flag's values."""
    return item.startswith("--") or bool(_OVERRIDE.match(item))


def _value(name: str, raw: list[str]) -> Any:
    """A flag's value: YAML-typed (a number where TRL's field is one), a list for several values or a list
    field, `true` for a bare flag."""
    if not raw:
        return True
    values = [_typed(name, item) for item in raw]
    return values if len(values) > 1 or name in _LIST_FLAGS else values[0]


def _typed(name: str, raw: str) -> Any:
    """One value as YAML reads it; `1e-5` (a string to YAML) as a number where TRL's field is a number."""
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    kinds = {TRL_TYPES.get(name), *typing.get_args(TRL_TYPES.get(name))}
    if isinstance(value, str) and (float in kinds or int in kinds):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def with_flags(data: dict[str, Any], flags: dict[str, Any], source: str) -> dict[str, Any]:
    """`data` (a config file's, or empty) with TRL's flags: in a flat TRL config as its keys; in leangrpo's
    nested one at the field each names. A flag whose TRL meaning needs the flat config's translation
    (`--max_steps`, `--bf16`, ...) is refused on a nested config, in one line."""
    if not flags:
        return data
    if not data or is_trl_config(data):
        return {**data, **flags}
    out = dict(data)
    for name, value in flags.items():
        target = None if name in _TRANSLATED else _mapped(name)
        if target is None:
            raise ConfigError(
                f"--{name}: {source} is leangrpo's nested config, where this TRL flag has no field of its "
                f"own; set the leangrpo field as section.key=value (docs/trl.md)"
            )
        *parents, leaf = target.split(".")
        node = out
        for part in parents:
            child = dict(node.get(part) or {})  # copied: `data` stays as it was
            node[part] = child
            node = child
        node[leaf] = value
    return out
