"""The `_target_` allow-list: config data names a class of this project's packages, never arbitrary code.

A `_target_` (from a YAML or an override) is checked before anything is imported (`target_problem`), so
`os.system`, `builtins.eval`, `subprocess.Popen` or a look-alike package never run, not even for an
error message (`fields_of`).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

TARGET_PACKAGES = ("quantizers", "strategies", "harness")


def module_parts(parts: list[str]) -> int | None:
    """How many leading `parts` name a module of our packages, found on disk without importing anything
    (a package's `__init__` or a module's top level may run code; `__main__` runs a CLI). None: not ours."""
    spec = importlib.util.find_spec(parts[0])  # a top-level name: located, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    folder, n = Path(next(iter(spec.submodule_search_locations))), 1
    for part in parts[1:-1]:  # the last part is always the class (or an attribute of it)
        if (folder / part / "__init__.py").is_file():
            folder, n = folder / part, n + 1
        elif (folder / f"{part}.py").is_file():
            return n + 1
        else:
            break
    return n


def target_problem(where: str, target: Any) -> str | None:
    """Why `target` may not be instantiated (None when it names a class defined in TARGET_PACKAGES).

    The dotted path is checked before anything is imported: only public names (no `_x`, no `__main__`,
    whose import runs a command line), in an allowed package, down to an existing module file; then only
    that module is imported and the rest must lead to a class defined in the allowed packages.
    """
    rule = (f"{where}={target!r} is not allowed: a _target_ must name a class in this project's packages "
            f"({', '.join(p + '.' for p in TARGET_PACKAGES)})")
    parts = str(target).split(".") if isinstance(target, str) else []
    if (len(parts) < 2 or parts[0] not in TARGET_PACKAGES or not all(p.isidentifier() for p in parts)
            or any(p.startswith("_") for p in parts)):
        return rule
    n = module_parts(parts)
    if n is None:
        return rule
    module = ".".join(parts[:n])
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:  # one of our modules imports something that is missing
        return f"{where}={target!r} could not be imported: {exc}"
    for name in parts[n:]:
        obj = getattr(obj, name, None)
    if not inspect.isclass(obj) or str(obj.__module__).split(".")[0] not in TARGET_PACKAGES:
        return rule  # a function, a module, or a class re-exported from elsewhere (harness.config.os.system)
    return None


def target_problems(section: str, node: Any) -> list[str]:
    """Every `_target_` in `node`, nested ones too (a draft quantizer inside a strategy), checked."""
    if isinstance(node, dict):
        out = [p for p in [target_problem(f"{section}._target_", node["_target_"])] if p] if "_target_" in node else []
        for key, value in node.items():
            out += target_problems(f"{section}.{key}", value)
        return out
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in target_problems(f"{section}[{i}]", v)]
    return []


def target_class(target: Any) -> type | None:
    """The dataclass `target` names (None when it is not allowed, cannot be imported or is not a dataclass)."""
    if not isinstance(target, str) or target_problem("_target_", target):  # never import what the allow-list refuses
        return None
    mod, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(mod), name)
    except Exception:  # noqa: BLE001 - only used to check values and enrich error messages
        return None
    return cls if dataclasses.is_dataclass(cls) else None


def fields_of(target: str) -> list[str]:
    """The public fields of the class `target` names ([] when it is not allowed or not a dataclass)."""
    cls = target_class(target)
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")] if cls else []
