"""Task accuracy: BIG-bench multiple choice scored through lm-evaluation-harness, paired with the reference.

The tasks (harness/analysis/tasks.py) are built as lm-eval `ConfigurableTask`s over the local task files (a custom
dataset: nothing from the hub) and scored in-process on the model object the run has just measured (lm-eval's
HFLM wraps the already-quantized transformers model; engine=llama_cpp scores through its own log-likelihoods
with the same tokenization, harness/run/llama_cpp.py). Framing, BIG-bench's zero-shot default: the prompt is
"Q: <input>\\nA:" and each choice is scored as the continuation " <choice>"; `acc` picks the choice with the
highest summed log-likelihood, `acc_norm` the highest log-likelihood per character of the choice (lm-eval's
definitions). An example counts as right when the pick has the highest target score. `accuracy.num_fewshot=k`
puts k solved examples of the same task before the question (lm-eval's seeded sampler, never the example
itself, "\\n\\n" between them). `accuracy.task_limit=N` scores a seeded subset of N examples per task.

Pairing: the reference (the same model unquantized, in `accuracy.reference_dtype`) answers the same examples
once; its per-example answers are cached like the KL record, one JSON per (model, task file, examples,
settings, library versions) under $QUANTBENCH_CACHE/reference/tasks/. Metrics per task t, for m = acc and
acc_norm: `task_<t>_<m>` and `_<m>_stderr` (lm-eval's: sample sd / sqrt(n)), `_<m>_ref`, `_<m>_diff` (run -
reference, same examples) with its paired stderr `_<m>_diff_stderr`, `_<m>_right_to_wrong` and
`_<m>_wrong_to_right` (the flips) and `_<m>_mcnemar_p`, McNemar's exact test on those flips (statsmodels): the
probability of at least this lopsided a split of the changed answers if the quantizer changed none on
purpose. Unpaired tests on paired data (lm-eval's own model comparison) lose most of this power. Over all
tasks: `tasks_<m>_mean`, `_ref_mean`, `_diff_mean` (unweighted averages over tasks), the summed flips, the pooled
McNemar p and `tasks_<m>_diff_pooled` (+ `_se`), the difference over all examples those flips give, and
`tasks_examples`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.analysis import intervals
from harness.analysis import tasks as T
from harness.cache import cache_root
from harness.errors import QuantbenchError
from harness.models import load_pretrained

# lm_eval, datasets, statsmodels (the optional `tasks` extra) and torch/transformers are imported where used: config
# validation imports this module, and a machine without the extra must still run everything else
# (tests/test_layout.py, LAZY_OK).

log = logging.getLogger("quantbench")

FRAMING = "bigbench-qa-1"  # "Q: <input>\nA:" + " <choice>"; change it when the prompt changes (keys the records)
RECORD_FORMAT = "1"
METRICS = ("acc", "acc_norm")
INSTALL_HINT = ("accuracy.tasks needs lm-eval and statsmodels (the `tasks` extra), which are not installed: run "
                "scripts/setup.sh, or pip install -c constraints.txt -e '.[tasks]'")


def installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("lm_eval", "statsmodels"))


@dataclass
class Answers:
    """One model's answers to one task's chosen examples (what the reference record stores)."""

    indices: list[int]  # example positions in the task file
    lls: list[list[float]]  # log-likelihood of each choice
    acc: list[int]  # 1: the highest summed log-likelihood picks a right choice
    acc_norm: list[int]  # 1: the highest log-likelihood per character does
    stderr: dict[str, float]  # lm-eval's stderr of each metric's mean


@dataclass
class Plan:
    """The tasks, the chosen examples and the reference's answers: everything a run's task pass needs."""

    tasks: list[T.Task]
    picks: dict[str, list[int]]
    reference: dict[str, Answers]
    cache_hit: bool  # every task's reference came from the cache


# ------------------------------------------------------------------------------------------ lm-eval tasks


def lm_task(task: T.Task, num_fewshot: int, seed: int) -> Any:
    """The task as an lm-eval ConfigurableTask over the local examples (a custom dataset, no hub)."""
    import datasets
    from lm_eval.api.task import ConfigurableTask

    rows = [{"idx": i, "input": e.input.strip(), "choices": list(e.choices), "gold": list(e.gold)}
            for i, e in enumerate(task.examples)]

    def dataset(**_: Any) -> Any:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

    config = {
        "task": task.name, "custom_dataset": dataset, "output_type": "multiple_choice",
        "test_split": "test", "fewshot_split": "test",  # BIG-bench has one split: shots come from it, never the doc
        "doc_to_text": lambda d: f"Q: {d['input']}\nA:", "doc_to_choice": lambda d: d["choices"],
        "doc_to_target": lambda d: d["gold"],  # a list: lm-eval counts a pick in it as right
        "target_delimiter": " ", "fewshot_delimiter": "\n\n", "num_fewshot": num_fewshot,
        # a shot's answer is rendered from doc_to_target, which must then be the text of one right choice
        "fewshot_config": {"sampler": "default", "doc_to_target": lambda d: d["choices"][d["gold"][0]]},
        "metric_list": [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in METRICS],
        "metadata": {"version": 1},
    }
    _quiet()
    lm_t = ConfigurableTask(config=config)
    lm_t.set_fewshot_seed(seed)
    return lm_t


def _quiet() -> None:
    """lm-eval's warnings about its own CLI and multi-process launch ("custom kwargs can be passed to
    --metadata", "pretrained model kwarg is not of type str") do not apply to an in-process call."""
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.ERROR)


def answer(lm: Any, tasks: list[T.Task], picks: dict[str, list[int]], num_fewshot: int, seed: int
           ) -> dict[str, Answers]:
    """Score `tasks` on the chosen examples with an lm-eval LM (HFLM or the llama.cpp one)."""
    from lm_eval import evaluator

    task_dict = {t.name: lm_task(t, num_fewshot, seed) for t in tasks}
    out = evaluator.evaluate(lm=lm, task_dict=task_dict, samples={t.name: picks[t.name] for t in tasks},
                             log_samples=True, bootstrap_iters=100, verbosity="ERROR")  # mean: closed-form stderr
    answers = {}
    for t in tasks:
        samples = sorted(out["samples"][t.name], key=lambda s: s["doc_id"])
        res = out["results"][t.name]
        answers[t.name] = Answers(
            indices=[int(s["doc_id"]) for s in samples],
            lls=[[float(r[0]) for r in s["filtered_resps"]] for s in samples],
            acc=[int(s["acc"]) for s in samples], acc_norm=[int(s["acc_norm"]) for s in samples],
            stderr={m: _float(res.get(f"{m}_stderr,none")) for m in METRICS})
        if answers[t.name].indices != picks[t.name]:
            raise QuantbenchError(f"task {t.name}: lm-eval scored other examples than asked for; report this")
    return answers


def _float(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):  # "N/A" for a single example
        return float("nan")


def hf_lm(model: Any, tokenizer: Any, batch_size: int) -> Any:
    """lm-eval's HFLM around a model object already in memory (quantized or not: it is not reloaded)."""
    from lm_eval.models.huggingface import HFLM

    class FloatLogitsHFLM(HFLM):
        """HFLM takes the log-softmax in the logits' dtype: for a bf16 model that rounds every log-likelihood to
        bf16 (3 significant digits), flipping near-tied answers that the weights did not flip. Upcast first, as
        the perplexity and KL passes do."""

        def _model_call(self, inps: Any, attn_mask: Any = None, labels: Any = None) -> Any:
            return super()._model_call(inps, attn_mask, labels).float()

    _quiet()
    return FloatLogitsHFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)


# --------------------------------------------------------------------------------- the reference record


def records_dir() -> Path:
    return cache_root() / "reference" / "tasks"


def record_path(identity: dict, task: T.Task, indices: list[int], cfg: Any) -> Path:
    import lm_eval
    import torch
    import transformers

    key = {"format": RECORD_FORMAT, "framing": FRAMING, "model": identity, "task": task.name,
           "task_sha256": task.sha256, "examples": hashlib.sha256(json.dumps(indices).encode()).hexdigest(),
           "num_fewshot": cfg.num_fewshot, "seed": cfg.task_seed, "dtype": cfg.reference_dtype,
           "batch_size": cfg.task_batch_size, "torch": torch.__version__, "transformers": transformers.__version__,
           "lm_eval": lm_eval.__version__}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return records_dir() / f"{task.name.replace('/', '--')}-{digest}.json"


def read_record(path: Path) -> Answers | None:
    try:
        data = json.loads(path.read_text())
        return Answers(**data["answers"]) if data.get("format") == RECORD_FORMAT else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_record(path: Path, answers: Answers, meta: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"format": RECORD_FORMAT, "meta": meta, "answers": asdict(answers)}))
    os.replace(tmp, path)


def prepare(source: Any, tokenizer: Any, cfg: Any, device: str) -> Plan:
    """Load the tasks, choose the examples, and get the reference's answers (computed once, then cached).

    Called before the run's own model loads, so the reference model is gone before peak memory is tracked.
    """
    if not installed():
        raise QuantbenchError(INSTALL_HINT)
    tasks = [T.load(name) for name in T.expand(cfg.tasks)]
    picks = {t.name: T.subset(len(t.examples), cfg.task_limit, cfg.task_seed) for t in tasks}
    paths = {t.name: record_path(source.identity(), t, picks[t.name], cfg) for t in tasks}
    reference = {t.name: a for t in tasks if (a := read_record(paths[t.name])) is not None}
    missing = [t for t in tasks if t.name not in reference]
    if missing:
        t0 = time.perf_counter()
        ref_model = load_pretrained(source, cfg.reference_dtype, device)
        got = answer(hf_lm(ref_model, tokenizer, cfg.task_batch_size), missing, picks, cfg.num_fewshot, cfg.task_seed)
        del ref_model
        for t in missing:
            write_record(paths[t.name], got[t.name], {"task": t.name, "dtype": cfg.reference_dtype})
            reference[t.name] = got[t.name]
        log.info("tasks: reference answers for %s in %.1f s (cached)", ", ".join(t.name for t in missing),
                 time.perf_counter() - t0)
    return Plan(tasks=tasks, picks=picks, reference=reference, cache_hit=not missing)


# ----------------------------------------------------------------------------------------------- pairing


def mcnemar_p(right_to_wrong: int, wrong_to_right: int) -> float:
    """McNemar's exact test (binomial on the discordant pairs); 1.0 when no answer changed."""
    from statsmodels.stats.contingency_tables import mcnemar

    return float(mcnemar([[0, right_to_wrong], [wrong_to_right, 0]], exact=True).pvalue)


def paired(prefix: str, run: list[int], ref: list[int], stderr: float) -> dict[str, float]:
    """acc, its stderr, the reference, the paired difference, the flips and McNemar's p for one metric."""
    n = len(run)
    diffs = [a - b for a, b in zip(run, ref, strict=True)]
    mean_d = sum(diffs) / n
    sd = math.sqrt(sum((d - mean_d) ** 2 for d in diffs) / (n - 1)) if n > 1 else 0.0
    r2w = sum(1 for a, b in zip(run, ref, strict=True) if b and not a)
    w2r = sum(1 for a, b in zip(run, ref, strict=True) if a and not b)
    out = {prefix: sum(run) / n, f"{prefix}_ref": sum(ref) / n, f"{prefix}_diff": mean_d,
           f"{prefix}_diff_stderr": sd / math.sqrt(n), f"{prefix}_right_to_wrong": float(r2w),
           f"{prefix}_wrong_to_right": float(w2r), f"{prefix}_mcnemar_p": mcnemar_p(r2w, w2r)}
    if math.isfinite(stderr):
        out[f"{prefix}_stderr"] = stderr
    return out


def compare(plan: Plan, got: dict[str, Answers]) -> dict[str, float]:
    """Every task's paired metrics and the summary over tasks (module docstring)."""
    out: dict[str, float] = {}
    for t in plan.tasks:
        run, ref = got[t.name], plan.reference[t.name]
        if run.indices != ref.indices:
            raise QuantbenchError(f"task {t.name}: the run and its reference answered different examples")
        out[f"task_{t.name}_examples"] = float(len(run.indices))
        out[f"task_{t.name}_chance"] = sum(len(t.examples[i].gold) / len(t.examples[i].choices)
                                           for i in run.indices) / len(run.indices)
        for m in METRICS:
            out.update(paired(f"task_{t.name}_{m}", getattr(run, m), getattr(ref, m), run.stderr[m]))
    names = [t.name for t in plan.tasks]
    out["tasks_examples"] = sum(out[f"task_{n}_examples"] for n in names)
    for m in METRICS:
        for stat in ("", "_ref", "_diff"):
            out[f"tasks_{m}{stat}_mean"] = sum(out[f"task_{n}_{m}{stat}"] for n in names) / len(names)
        for flip in ("right_to_wrong", "wrong_to_right"):
            out[f"tasks_{m}_{flip}"] = sum(out[f"task_{n}_{m}_{flip}"] for n in names)
        out[f"tasks_{m}_mcnemar_p"] = mcnemar_p(int(out[f"tasks_{m}_right_to_wrong"]), int(out[f"tasks_{m}_wrong_to_right"]))
        # the difference the pooled flips and McNemar p describe (the frontier's): every example weighs the same
        diff, se = intervals.pooled_paired(out[f"tasks_{m}_right_to_wrong"], out[f"tasks_{m}_wrong_to_right"],
                                           out["tasks_examples"])
        if math.isfinite(diff):
            out[f"tasks_{m}_diff_pooled"], out[f"tasks_{m}_diff_pooled_se"] = diff, se
    return out


def score(lm: Any, plan: Plan, cfg: Any) -> tuple[dict[str, float], dict[str, str]]:
    """The run's task pass: its answers paired with the reference's; (metrics, tags)."""
    t0 = time.perf_counter()
    got = answer(lm, plan.tasks, plan.picks, cfg.num_fewshot, cfg.task_seed)
    metrics = compare(plan, got)
    metrics["tasks_s"] = time.perf_counter() - t0
    for t in plan.tasks:
        p = f"task_{t.name}_acc"
        log.info("task %s: acc %.3f (reference %.3f, %+.3f), %d right->wrong, %d wrong->right, McNemar p %.3g",
                 t.name, metrics[p], metrics[f"{p}_ref"], metrics[f"{p}_diff"], metrics[f"{p}_right_to_wrong"],
                 metrics[f"{p}_wrong_to_right"], metrics[f"{p}_mcnemar_p"])
    tags = {"tasks": ",".join(t.name for t in plan.tasks), "tasks.framing": FRAMING,
            "tasks.reference_cache": "hit" if plan.cache_hit else "miss", "tasks.source": T.source()}
    return metrics, tags


# ------------------------------------------------------------------------------------------- the report


def _fmt(m: dict, key: str, fmt: str) -> str:
    v = m.get(key)
    return "—" if not isinstance(v, (int, float)) or not math.isfinite(v) else fmt.format(v)


def section(rows: list[dict]) -> str:
    """report.md's per-task table: one line per (cell, task) of the cells that scored tasks."""
    lines = []
    for r in rows:
        m, names = r["metrics"], [n for n in (r["tags"].get("tasks") or "").split(",") if n]
        if r["status"] != "OK":
            continue
        for n in names:
            p = f"task_{n}_acc"
            if f"{p}_ref" not in m:
                continue
            acc = _fmt(m, p, "{:.3f}") + (f" ± {m[p + '_stderr']:.3f}" if f"{p}_stderr" in m else "")
            lines.append("| " + " | ".join([
                r["cell"].replace("|", "\\|"), n, _fmt(m, f"task_{n}_examples", "{:.0f}"),
                _fmt(m, f"task_{n}_chance", "{:.3f}"), _fmt(m, f"{p}_ref", "{:.3f}"), acc,
                _fmt(m, f"{p}_diff", "{:+.3f}") + " ± " + _fmt(m, f"{p}_diff_stderr", "{:.3f}"),
                _fmt(m, f"{p}_right_to_wrong", "{:.0f}"), _fmt(m, f"{p}_wrong_to_right", "{:.0f}"),
                _fmt(m, f"{p}_mcnemar_p", "{:.3g}"), _fmt(m, f"task_{n}_acc_norm_diff", "{:+.3f}"),
                _fmt(m, f"task_{n}_acc_norm_mcnemar_p", "{:.3g}")]) + " |")
    if not lines:
        return ""
    return "\n".join([
        "", "## Task accuracy, paired with the unquantized reference", "",
        "BIG-bench multiple choice through lm-eval (harness/analysis/task_accuracy.py): each cell's answers against the "
        "reference's (the same model unquantized) on the same examples. ✓→✗ / ✗→✓: answers that flipped; McNemar p: "
        "exact test on those flips (small = the quantizer changed answers beyond chance; acc can hold while answers "
        "flip). Δ: run − reference, paired stderr.", "",
        "| cell | task | n | chance | reference acc | acc ± se | Δ acc | ✓→✗ | ✗→✓ | McNemar p | Δ acc_norm | "
        "McNemar p (norm) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|", *lines]) + "\n"
