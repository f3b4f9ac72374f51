"""Group options (model, quantizer, strategy, engine): one built from its config node, every problem in one line.

The schema types the groups `Any` (harness/config.py), so Hydra checks neither their keys nor their values'
types. Before the class an option names is instantiated, its node is checked against that class: a required
value left unset (`???`: `model=gguf` without `model.path`), a value of the wrong type (true where an integer
goes, a word where a number goes), a string where a nested option goes (`strategy.draft_model=tiny_random`
instead of `+model@strategy.draft_model=tiny_random`). An unknown key is named with the keys the class takes
(`unknown_key`, shared with the compose-time message of harness/cli.py).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate

from harness.errors import ConfigError
from harness.schema import shown
from harness.targets import fields_of, target_class, target_problems

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"
HYDRA_KEYS = ("_target_", "_convert_", "_recursive_", "_partial_", "_args_")  # instantiate's own, not the class's
MISSING = "???"  # OmegaConf's mandatory value, left as this string by to_plain(throw_on_missing=False)
KINDS = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string",
         "int | None": "an integer or null", "float | None": "a number or null",
         "list[str]": "a list in brackets, e.g. '[a,b]'"}


def options(group: str) -> list[str]:
    """The options of a config group: the YAML files of conf/<group>/."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def quoted(value: Any) -> str:
    """A value as the command line spells it (schema.shown), a string in quotes: `'abc'` reads as the value given."""
    return repr(value) if isinstance(value, str) else shown(value)


def fits(kind: str, value: Any) -> bool:
    """Whether `value` has the type a field annotated `kind` takes (a bool is not a number)."""
    if value is None and kind.endswith("| None"):
        return True
    if kind in ("int", "int | None"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in ("float", "float | None"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    return True  # str (a number given to a str field is the class's to judge), tuples, Any


def required(section: str, key: str, target: str) -> str:
    """`section.key` left `???`: the option that needs it, and an example from its YAML's comments."""
    name = key.rsplit(".", 1)[-1]
    for path in sorted((CONF_DIR / section).glob("*.yaml")) if section.isidentifier() else []:
        text = path.read_text()
        if re.search(rf"^_target_: {re.escape(target)}$", text, re.M) and re.search(
                rf"^{re.escape(name)}: \?\?\?", text, re.M):
            example = re.search(rf"{re.escape(section)}\.{re.escape(name)}=(\S+)", text)
            return f"{key} is required: {section}={path.stem} {key}={example[1] if example else '<value>'}"
    return f"{key} is required (it has no default): add {key}=<value>"


def missing_problems(section: str, node: Any, target: str = "") -> list[str]:
    """Every value of `node` left `???`, nested options included."""
    if isinstance(node, dict):
        target = node.get("_target_", target)
        return [p for key, value in node.items() for p in (
            [required(section, f"{section}.{key}", target)] if value == MISSING
            else missing_problems(f"{section}.{key}", value, target))]
    return []


def unknown_key(section: str, key: str, target: str, value: Any = None) -> str:
    """`section.key` is not an argument of the option's class: what it takes (or that a + adds this key)."""
    cls, allowed = target.rsplit(".", 1)[-1], fields_of(target)
    if key in allowed:  # the class takes it but the option's YAML does not set it: Hydra adds a new key only with +
        return (f"{section}.{key}: the {section} option does not set this key of {cls}; add it with a +: "
                f"+{section}.{key}={'<value>' if value is None else value}")
    if not allowed:
        return f"{section}.{key} is not a known key: {cls} takes no options"
    return f"{section}.{key} ({cls}) is not a known key; allowed: {', '.join(allowed)}"


def nested_problem(key: str, group: str, value: Any) -> str:
    """A string where a nested option (a `group` config) goes: how Hydra's `group@key` override picks one."""
    plain, allowed = group.lstrip("+"), options(group.lstrip("+"))
    pick = value if value in allowed else "<option>"
    return (f"{key}={quoted(value)} is a name, not a {plain} config: pick the option with {group}@{key}={pick} "
            f"(one of: {', '.join(allowed)})")


def value_problems(section: str, node: dict) -> list[str]:
    """Unknown keys and values of the wrong type for the class `node` names, nested options included."""
    target = node.get("_target_")
    cls = target_class(target)
    if cls is None:
        return []
    nested = getattr(cls, "nested_options", {})  # field -> the group (with its + when the YAML has no default)
    allowed = fields_of(target)
    p = [unknown_key(section, key, target) for key in node if key not in HYDRA_KEYS and key not in allowed]
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or f.name not in node or node[f.name] == MISSING:
            continue
        key, value = f"{section}.{f.name}", node[f.name]
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
        if isinstance(value, dict) and "_target_" in value:
            p += value_problems(key, value)
        elif f.name in nested and value is not None:
            p.append(nested_problem(key, nested[f.name], value))
        elif not fits(kind, value):
            p.append(f"{key}={quoted(value)} must be {KINDS.get(kind, kind)}")
    return p


def instantiate_option(section: str, node: Any, problems: list[str]) -> Any:
    """The object `node` describes, or None with its problems appended to `problems`."""
    if node is None or not isinstance(node, dict) or "_target_" not in node:  # `~model` leaves a '???' string
        problems.append(f"{section}: no option chosen; pick one with {section}=<option> (see conf/{section}/)")
        return None
    if (bad := target_problems(section, node)):
        problems.extend(bad)
        return None
    if (bad := missing_problems(section, node) + value_problems(section, node)):
        problems.extend(bad)
        return None
    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as exc:  # unwrap to the class's own one-line message
        cause = exc.__cause__ or exc
        if isinstance(cause, ConfigError):
            problems.extend(cause.problems)
        elif isinstance(cause, TypeError) and "unexpected keyword argument" in str(cause):
            key = str(cause).rsplit("argument", 1)[-1].strip(" '")
            problems.append(unknown_key(section, key, node.get("_target_", "?")))
        else:
            problems.append(f"{section}: {cause}")
    except ConfigError as exc:
        problems.extend(exc.problems)
    return None
