"""A stand-in BIG-bench task cache for the test suite: the default task names, synthetic multiple-choice examples.

The suite never needs the real task files (a ~360 MB sdist that the registry stopped listing on 2026-12-05): every
test that scores tasks reads this cache through QUANTBENCH_TASKS_DIR, which conftest.py sets for the session and
every subprocess it starts. It is built by the same `harness.analysis.tasks.build_cache` as a real fetch, from
BIG-bench-shaped task.json bytes. Its index records `STANDIN` where a real fetch records the sdist's sha256, so a
run scored on it is tagged `tasks.source=not the pinned ...: stand-in ...` and never passes for the real thing.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.analysis import tasks as T

STANDIN = "stand-in (tests/standin_tasks.py)"
WORDS = ["red", "blue", "green", "seven", "Paris", "a cat", "the sea", "no"]


def mc_task(n: int, seed: int = 0, name: str = "toy") -> dict:
    """A BIG-bench-style multiple-choice task: 2-4 choices, one example with two right answers."""
    examples = []
    for i in range(n):
        k = 2 + (i + seed) % 3
        choices = [WORDS[(i * 3 + j + seed) % len(WORDS)] + ("" if j else " ") for j in range(k)]
        scores = {c: int(j == i % k) for j, c in enumerate(choices)}
        examples.append({"input": f"Question {i}: which one fits {WORDS[i % len(WORDS)]}? ", "target_scores": scores})
    examples[1]["target_scores"] = {c: 1 if j < 2 else 0 for j, c in enumerate(examples[1]["target_scores"])}
    return {"name": name, "examples": examples}


def build(root: Path, n: int = 24) -> Path:
    """The stand-in cache in `root`: each default task with `n` examples, plus a generative and a programmatic
    task, as a real cache has them. Returns `root`."""
    members: list[tuple[str, bytes | None]] = [
        (name, json.dumps(mc_task(n, seed, name)).encode()) for seed, name in enumerate(T.DEFAULT_TASKS)]
    members += [("arithmetic_gen", json.dumps({"examples": [{"input": "2+2=", "target": "4"}]}).encode()),
                ("program_task", None)]
    T.build_cache(members, root, STANDIN)
    return root
