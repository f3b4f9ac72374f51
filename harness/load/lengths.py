"""Request lengths for a load run (`load.lengths`), and prompts of those lengths.

A spec is one of
- `chat` (default): harness/data/chat_lengths.jsonl, a small synthetic file shaped like chat traffic
  (long-tailed prompts, shorter outputs); its first line says where its parameters came from;
- `fixed:P/O`: every request P prompt tokens and O output tokens;
- `uniform:P1-P2/O1-O2`: lengths drawn uniformly (inclusive) from those ranges;
- a `.jsonl` file: one `{"prompt_tokens": P, "output_tokens": O}` per line (a line holding only `_comment`
  is skipped), drawn with replacement;
- `workload`: the run's own prompts (`measure.prompts`, with their per-prompt `max_new_tokens`), cycled: the
  same prompts at every rate (run.py tags it `load.prefix_reuse=true`).
Draws are seeded by `load.seed`. Prompt ids are windows of real English text (the builtin corpus and the
calibration text, tokenized by the run's tokenizer), so a server sees ordinary tokens, never random ids.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

from harness.errors import QuantbenchError
from harness.measure.workloads import random_ids

DATA = Path(__file__).resolve().parents[1] / "data"
CHAT = DATA / "chat_lengths.jsonl"
TEXTS = (DATA / "corpus.txt", DATA / "calibration.txt")
_FIXED = re.compile(r"^fixed:(\d+)/(\d+)$")
_UNIFORM = re.compile(r"^uniform:(\d+)-(\d+)/(\d+)-(\d+)$")
FORMS = "chat | workload | fixed:P/O | uniform:P1-P2/O1-O2 | a .jsonl file of {prompt_tokens, output_tokens}"


def read_jsonl(path: Path) -> list[tuple[int, int]]:
    """The (prompt_tokens, output_tokens) pairs of a lengths file; ValueError names the bad line."""
    pairs = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"line {i} of {path.name} is not JSON ({exc.msg})") from exc
        if not isinstance(row, dict):  # a number or null raised a bare TypeError ("'int' object is not iterable")
            raise ValueError(f"line {i} of {path.name} is not a JSON object; want "
                             '{"prompt_tokens": P, "output_tokens": O}')
        if set(row) == {"_comment"}:
            continue
        if set(row) != {"prompt_tokens", "output_tokens"}:
            raise ValueError(f"line {i} of {path.name} has keys {sorted(row)}; want prompt_tokens and output_tokens")
        p, o = row["prompt_tokens"], row["output_tokens"]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (p, o)):  # JSON true is no 1
            raise ValueError(f"line {i} of {path.name}: prompt_tokens and output_tokens must be integers >= 1")
        pairs.append((p, o))
    if not pairs:
        raise ValueError("no lengths in it")
    return pairs


def spec_problem(spec: str) -> str | None:
    """Why `load.lengths` cannot be used (config time, no tokenizer), else None."""
    if spec in ("chat", "workload"):
        return None
    if (m := _FIXED.match(spec)) or (m := _UNIFORM.match(spec)):
        nums = [int(g) for g in m.groups()]
        if min(nums) < 1 or (len(nums) == 4 and (nums[0] > nums[1] or nums[2] > nums[3])):
            return f"load.lengths={spec!r}: lengths must be >= 1 and each range low-high"
        return None
    if spec.endswith(".jsonl"):
        path = Path(spec).expanduser()
        if not path.is_file():
            return f"load.lengths={spec!r}: no such file"
        try:
            read_jsonl(path)
        except (ValueError, json.JSONDecodeError) as exc:
            return f"load.lengths={spec!r}: {exc}"
        return None
    return f"load.lengths={spec!r} is not a length spec; use {FORMS}"


def draw(spec: str, n: int, seed: int) -> list[tuple[int, int]]:
    """n (prompt_tokens, output_tokens) pairs from a spec other than `workload`, seeded.

    A stream of its own (`lengths:<seed>`): driver.schedule draws the arrival gaps from random.Random(seed), and
    from one stream a long prompt came with a long gap after it (uniform lengths: correlation 0.87), which hid
    queueing and flattered TTFT and capacity."""
    rng = random.Random(f"lengths:{seed}")
    if (m := _FIXED.match(spec)):
        return [(int(m[1]), int(m[2]))] * n
    if (m := _UNIFORM.match(spec)):
        a, b, c, d = (int(g) for g in m.groups())
        return [(rng.randint(a, b), rng.randint(c, d)) for _ in range(n)]
    pairs = read_jsonl(CHAT if spec == "chat" else Path(spec).expanduser())
    return [rng.choice(pairs) for _ in range(n)]


def text_ids(tokenizer: Any) -> list[int] | None:
    """The token stream prompts are cut from: real English text, without special tokens; None for a model
    without a text tokenizer (model=random)."""
    text = "\n\n".join(p.read_text() for p in TEXTS)
    try:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    except QuantbenchError:
        return None


def prompts(tokenizer: Any, stream: list[int] | None, lengths: list[int], seed: int) -> list[list[int]]:
    """One prompt of each length: a window of `stream` (text_ids) at a seeded offset, the stream repeating; seeded
    random ordinary ids where there is no stream."""
    if stream is None:
        return [random_ids(tokenizer, n, seed, 100 + i) for i, n in enumerate(lengths)]
    rng = random.Random(seed + 1)
    starts = [rng.randrange(len(stream)) for _ in lengths]
    return [[stream[(s + j) % len(stream)] for j in range(n)] for s, n in zip(starts, lengths, strict=True)]
