"""Prompt sources: the fixed prompt sets, and `measure.prompts` parsed without a tokenizer.

A benchmark is only comparable on the same prompts. `default` mixes lengths (short question to a
paragraph) so TTFT and decode are both exercised. `edit` is input-grounded (the answer copies spans of
the prompt): where prompt-lookup drafting shines.

`parse(measure.prompts)` reads a named set, a text or JSONL file, or `synthetic[:N]` into a `Source`
(the formats: harness/measure/workloads.py's docstring); `source_problems` is the config-time check. Neither
needs a model or a tokenizer; harness/measure/workloads.py turns a `Source` into token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import ConfigError

SYNTHETIC = "synthetic"
SYNTHETIC_DEFAULT_COUNT = 4  # as many prompts as the named sets: the same number of samples per pass
JSONL_KEYS = ("prompt", "max_new_tokens")

PROMPT_SETS: dict[str, list[str]] = {
    "default": [
        "What is the capital of France?",
        "Explain in two sentences why the sky looks blue during the day.",
        "Write a short story about a lighthouse keeper who finds a message in a bottle. "
        "Keep it under one hundred words and give it a hopeful ending.",
        "Summarize the following note for a busy manager: The build server ran out of disk space on "
        "Tuesday night, so the nightly tests did not run. On Wednesday morning the team cleared old "
        "artifacts, added an alert at eighty percent usage, and re-ran the tests, which all passed. "
        "No release was delayed.",
    ],
    "edit": [
        "Rename the variable `count` to `total` in this function and return the full function:\n"
        "def add_all(values):\n    count = 0\n    for v in values:\n        count += v\n    return count\n",
        "Fix the spelling mistakes and repeat the paragraph: The quick brown fox jumpd over the lazy dog. "
        "It was a sunny day and the fox was verry happy. The dog did not mind at all.",
        "Convert this list to a numbered list and keep every item: - flour - sugar - eggs - butter - milk",
        "Add type hints to this function and return the full function:\n"
        "def greet(name, times):\n    for _ in range(times):\n        print('Hello, ' + name)\n",
    ],
}


@dataclass
class Source:
    """`measure.prompts` parsed without a tokenizer."""

    kind: str  # set | text | jsonl | synthetic
    name: str  # the set name, the file path, or "synthetic"
    texts: list[str] = field(default_factory=list)
    limits: list[int | None] = field(default_factory=list)  # per-prompt max_new_tokens (JSONL), else None
    lines: list[int] = field(default_factory=list)  # 1-based line where each prompt starts (files)
    count: int = 0  # synthetic: number of prompts

    def where(self, i: int) -> str:
        return f"{self.name}:{self.lines[i]}" if self.lines else f"{self.name}[{i}]"


def _allowed() -> str:
    return ", ".join([*sorted(PROMPT_SETS), SYNTHETIC, "synthetic:N"]) + ", or a .txt/.jsonl file path"


def parse(value: str) -> Source:
    """Parse `measure.prompts`; raises QuantbenchError with one line per problem (file and line number)."""
    if value in PROMPT_SETS:
        return Source("set", value, list(PROMPT_SETS[value]), [None] * len(PROMPT_SETS[value]))
    if value == SYNTHETIC or value.startswith(SYNTHETIC + ":"):
        count = value.partition(":")[2] or str(SYNTHETIC_DEFAULT_COUNT)
        if not count.isdigit() or int(count) < 1:
            raise ConfigError([f"measure.prompts={value!r}: the count after 'synthetic:' must be an integer >= 1 "
                               "(e.g. synthetic:8)"])
        return Source("synthetic", SYNTHETIC, count=int(count))
    path = Path(value)
    if not path.exists():
        raise ConfigError([f"measure.prompts={value!r} is not allowed; choose one of: {_allowed()} "
                           f"(no such file: {path})"])
    if not path.is_file():
        raise ConfigError([f"measure.prompts={value!r} is a directory; give a .txt or .jsonl file"])
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([f"measure.prompts={value!r} cannot be read as UTF-8 text ({exc})"]) from None
    src = _parse_jsonl(value, text) if path.suffix.lower() == ".jsonl" else _parse_text(value, text)
    if not src.texts:
        raise ConfigError([f"measure.prompts={value!r} holds no prompts (the file is empty); "
                           + ("write one JSON object per line: {\"prompt\": \"...\"}" if src.kind == "jsonl"
                              else "write prompts separated by blank lines")])
    return src


def _parse_text(name: str, text: str) -> Source:
    src = Source("text", name)
    block: list[str] = []
    start = 0
    for n, line in enumerate(text.splitlines() + [""], start=1):
        if line.strip():
            if not block:
                start = n
            block.append(line)
        elif block:
            src.texts.append("\n".join(block))
            src.limits.append(None)
            src.lines.append(start)
            block = []
    return src


def _parse_jsonl(name: str, text: str) -> Source:
    src, problems = Source("jsonl", name), []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        at = f"measure.prompts={name}:{n}"
        try:
            obj = json.loads(line)
        except ValueError as exc:
            problems.append(f"{at}: not valid JSON ({exc}); write one object per line: "
                            '{"prompt": "...", "max_new_tokens": 64}')
            continue
        if not isinstance(obj, dict):
            problems.append(f'{at}: expected a JSON object {{"prompt": ...}}, got {type(obj).__name__}')
            continue
        unknown = sorted(set(obj) - set(JSONL_KEYS))
        prompt, limit = obj.get("prompt"), obj.get("max_new_tokens")
        if unknown:
            problems.append(f"{at}: unknown key(s) {', '.join(map(repr, unknown))}; allowed: {', '.join(JSONL_KEYS)}")
        elif not isinstance(prompt, str) or not prompt.strip():
            problems.append(f'{at}: "prompt" must be a non-empty string')
        elif limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            problems.append(f'{at}: "max_new_tokens" must be an integer >= 1, got {limit!r}')
        else:
            src.texts.append(prompt)
            src.limits.append(limit)
            src.lines.append(n)
    if problems:
        raise ConfigError(problems[:5] + ([f"... and {len(problems) - 5} more bad line(s)"] if len(problems) > 5
                                          else []))
    return src


def source_problems(measure: Any) -> list[str]:
    """Config-time problems of the workload settings (no model, no tokenizer)."""
    p: list[str] = []
    try:
        src = parse(str(measure.prompts))
    except ConfigError as exc:
        return list(exc.problems)
    n = measure.prompt_tokens
    if src.kind == "synthetic" and isinstance(n, int) and n < 1:
        p.append(f"measure.prompts={measure.prompts} needs the prompt length: add measure.prompt_tokens=<n> (e.g. 512)")
    elif src.kind != "synthetic" and isinstance(n, int) and n > 0:
        p.append(f"measure.prompt_tokens={n} applies to measure.prompts=synthetic only (measure.prompts="
                 f"{measure.prompts} has its own lengths); drop it or use measure.prompts=synthetic")
    return p
