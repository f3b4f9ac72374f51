"""The report's view of a sweep's cells: one row per result dict, with its speed ratio to the baseline cell.

A ratio only compares like with like: the baseline cell of the same machine, model, strategy, batch size and
context depth (`group`), run with the same speed settings (`SPEED_KEYS`: threads, tokens, prompts, dtype, device,
cache, compile settings, seed, ...)
and, where the rows hold several invocations of a sweep, from the same invocation when it has one. A cell with no
such baseline gets no ratio rather than one against another shape's, another machine's or another thread count's
speed (a gpu_scaling sweep runs three model shapes; a merged report can hold two CPUs; a sweep may vary threads).
Settings a format sets itself (measure.path, measure.compile: conf/format's `*_eager`) are part of the compared
format, not of the key. A llama.cpp cell's format is `llama_cpp:<format>` (engine.format), never `none`."""

from __future__ import annotations

from typing import Any

from harness.metrics import HEADLINE
from harness.metrics import value as _num  # a finite float or None


def describe(cell: dict) -> dict[str, Any]:
    """The report's view of one result dict."""
    tags, m, config = cell.get("tags") or {}, cell.get("metrics") or {}, cell.get("config") or {}
    batch = _num(m, "batch_size") or _num(config.get("strategy") or {}, "batch_size") or 1.0
    depth = _num(m, "context_depth_tokens") or _num(config.get("measure") or {}, "context_depth") or 0.0
    return {
        "cell": tags.get("sweep.cell") or cell.get("run_name") or "?",
        "model": tags.get("model.name") or "?",
        "machine": machine_key(tags),
        "quantizer": (f"llama_cpp:{tags.get('engine.format') or (config.get('engine') or {}).get('format') or '?'}"
                      if tags.get("engine") == "llama_cpp" or tags.get("choice.engine") == "llama_cpp"
                      else tags.get("quantizer.name") or tags.get("choice.quantizer") or "?"),
        "setting": setting(config, tags),
        "invocation": tags.get("quantbench.invocation", ""),
        "strategy": tags.get("strategy.name") or tags.get("choice.strategy") or "?",
        "batch": int(batch),
        "depth": int(depth),  # measure.context_depth: tokens in the KV cache before the prompt
        "tags": tags,
        "status": cell.get("status", "?"),
        "error": cell.get("error", ""),
        "metrics": m,
        "children": cell.get("children") or [],  # a load run's rates (harness/load/report.py)
    }


def machine_key(tags: dict) -> str:
    """The machine a cell ran on: the GPU's name on CUDA, else the CPU's vendor, family and model."""
    if str(tags.get("device", "")).startswith("cuda") and tags.get("device_name"):
        return str(tags["device_name"])
    return f"{tags.get('cpu.vendor') or tags.get('cpu_model') or '?'} family {tags.get('cpu.family', '?')} " \
           f"model {tags.get('cpu.model', '?')}"


def group(r: dict) -> str:
    """The cells of one machine a speed ratio may compare: same model, strategy, batch size and context depth."""
    return f"{r['model']} / {r['strategy']} / batch {r['batch']}" + (f" / depth {r['depth']}" if r.get("depth") else "")


SPEED_KEYS = ("measure.threads", "measure.max_new_tokens", "measure.prompts", "measure.prompt_tokens",
              "measure.chat_template", "measure.device", "model.dtype",
              # every other measure.* key that changes what a step does: a sweep of measure.cache=dynamic,static
              # took the first `none` cell as the baseline of every row (bf16 on a static cache / none on a
              # dynamic one). Not measure.path: conf/format's `*_eager` set it, it is part of the compared format
              "measure.stop_at_eos", "measure.seed", "measure.warmup", "measure.gemv", "measure.hugepages",
              "measure.cache", "measure.compile", "measure.compile_mode", "measure.compile_freezing",
              "measure.compile_backend", "measure.compile_cpp_wrapper", "measure.compile_skip_guards",
              "measure.inject_slowdown", "measure.inject_work")


def setting(config: dict, tags: dict) -> str:
    """The speed settings a ratio must hold equal (module docstring): the threads the run used, then SPEED_KEYS."""
    values = [str(tags.get("threads", ""))]
    for key in SPEED_KEYS:
        section, _, name = key.partition(".")
        values.append(str((config.get(section) or {}).get(name, "")))
    return "|".join(values)


SETTING_NAMES = ("threads", *SPEED_KEYS)  # the parts of `setting`, in its order


def setting_labels(rows: list[dict]) -> dict[str, str]:
    """Each row's `setting` -> the parts of it that differ between `rows`, named ("threads 1,
    measure.max_new_tokens=16"); '' where every row has the same. For headings that must tell apart cells a ratio
    never compares (harness/analysis/frontier.py)."""
    found = {s: s.split("|") for s in dict.fromkeys(r.get("setting", "") for r in rows)}
    width = len(SETTING_NAMES)
    differ = [i for i in range(width) if len({v[i] if len(v) == width else "" for v in found.values()}) > 1]
    if 0 in differ:  # the threads a run used say it: "threads 1", not also "measure.threads=1"
        differ = [i for i in differ if SETTING_NAMES[i] != "measure.threads"]
    return {s: ", ".join(f"threads {v[i]}" if i == 0 else f"{SETTING_NAMES[i]}={v[i]}" for i in differ)
            if len(v) == width else s for s, v in found.items()}


def baseline_key(r: dict) -> tuple[str, str, str]:
    """What a cell's ratio compares within: machine, group and speed settings (module docstring)."""
    return r["machine"], group(r), r.get("setting", "")


def baselines(rows: list[dict], baseline: str, speed: Any = None) -> dict[tuple, Any]:
    """`speed(row)` of each key's baseline cell (default its headline tok/s; the crossover map keeps the row), per
    invocation and (the first found) for any invocation: `lookup` reads it."""
    speed = speed or (lambda r: _num(r["metrics"], HEADLINE))
    out: dict[tuple, Any] = {}
    for r in rows:
        if r["status"] == "OK" and r["quantizer"] == baseline and (tps := speed(r)):
            out.setdefault((*baseline_key(r), r.get("invocation", "")), tps)
            out.setdefault((*baseline_key(r), None), tps)
    return out


def lookup(speeds: dict[tuple, Any], r: dict) -> Any:
    """The baseline of row `r`: its own invocation's, else any invocation's with the same key."""
    return speeds.get((*baseline_key(r), r.get("invocation", ""))) or speeds.get((*baseline_key(r), None))


def rows_for(cells: list[dict], baseline: str = "none") -> list[dict]:
    rows = [describe(c) for c in cells]
    speeds = baselines(rows, baseline)
    for r in rows:
        base = lookup(speeds, r)
        tps = _num(r["metrics"], HEADLINE)
        r["ratio"] = tps / base if (tps and base and r["status"] == "OK") else None
    return rows


def machines(rows: list[dict]) -> list[str]:
    """The distinct machines the cells ran on (CPU model, ISA tags, threads; GPU name when one ran)."""
    seen: dict[str, None] = {}
    for r in rows:
        t = r["tags"]
        if not t.get("cpu.isa") and not t.get("device_name"):
            continue
        cpu = f"{t.get('cpu_model', '?')} (family {t.get('cpu.family', '?')} model {t.get('cpu.model', '?')}, " \
              f"{t.get('cpu.isa', '?')}, bf16 {t.get('cpu.bf16', '?')}), {t.get('threads', '?')} threads"
        gpu = t.get("device_name", "") if str(t.get("device", "")).startswith("cuda") else ""
        seen[f"{gpu} on {cpu}" if gpu else cpu] = None
    return list(seen)
