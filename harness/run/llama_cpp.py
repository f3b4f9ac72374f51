"""llama.cpp as a peer engine (`engine=llama_cpp`): the same GGUF, prompts, greedy decoding and metrics.

The peer runs through llama-cpp-python (optional extra: it compiles llama.cpp; `scripts/setup.sh --all`).
To compare like with like, the prompts and the perplexity corpus are tokenized with the *same* HF
tokenizer the transformers engine uses (for SmolLM2 both tokenizers give identical ids) and the token
ids are fed to llama.cpp directly; perplexity uses the same `accuracy.windows` and scoring rule.
Workloads (`measure.prompts`, `prompt_tokens`, `context_depth`, per-prompt lengths) resolve to the same ids
as engine=transformers (harness/measure/workloads.py); a depth context is evaluated once, untimed, and every call
starts on top of it (`n_tokens = depth`: `eval` drops the KV positions after it).

Decoding uses llama.cpp's own batch/decode calls through `Llama.eval` with `logits_all=False`, and
reads the last position's logits with `llama_get_logits_ith(ctx, -1)`: in llama-cpp-python 0.3.36
`eval` no longer fills `Llama.scores` in that mode (argmax over it silently picks token 0). Every step
is timed on the host clock around eval + logits + argmax, like the transformers loop (llama.cpp on CPU
is synchronous), and the decode phase as a whole by the wall clock from the first token on the host to
the last (`Generation.decode_wall_s`: decode tokens/s). Perplexity requests logits for every position of
a window (one decode per window).

Formats: `engine.format=gguf` runs the file as shipped; F32, BF16, F16, Q8_0, Q4_0, Q4_1 convert it with
`llama_model_quantize(allow_requantize=True)` into the cache (seconds for a 135M model). Requantizing
an already-quantized GGUF starts from its dequantized values, so a Q8_0 made from a Q4_1 file carries
the Q4_1 error (the same holds for transformers, which loads this GGUF dequantized).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from harness import env, gguf_meta, measure, third_party_output
from harness.analysis import accuracy
from harness.analysis.roofline import ModelShape, shape_from_gguf
from harness.cache import build_lock, cache_root, file_key, require_free, short_hash
from harness.config import Experiment
from harness.errors import ConfigError, QuantbenchError, one_of
from harness.measure import memory, workloads
from harness.measure.one_row import gemv_choice, sixteen_choice
from harness.measure.workloads import encode_prompts  # noqa: F401 - re-exported (tests)
from harness.run import llama_cpp_lm
from harness.run.hooks import Record, Session
from harness.schema import COMPILE_ONLY, set_apart
from strategies.inject import injected_step

log = logging.getLogger("quantbench")

# llama_ftype values (llama.h); only what `llama_model_quantize` makes from any source file
FORMATS = {"gguf": None, "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
# stored bytes per weight of each format's matrices (ggml block sizes: Q8_0 34 B, Q4_0 18 B, Q4_1 20 B per 32)
BYTES_PER_WEIGHT = {"F32": 4.0, "F16": 2.0, "BF16": 2.0, "Q8_0": 34 / 32, "Q4_0": 18 / 32, "Q4_1": 20 / 32}
# measure settings only engine=transformers reads: their defaults and `auto` (pick what applies: nothing here, so a
# sweep may set hugepages=auto for every engine, as conf/experiment/scaling.yaml does) pass; explicit others are refused
TRANSFORMERS_ONLY = {"path": ("best",), "gemv": ("auto",), "hugepages": ("off", "auto"), **COMPILE_ONLY}
INSTALL_HINT = ("engine=llama_cpp needs llama-cpp-python, which is not installed; install the extra with "
                "`scripts/setup.sh --all` (compiles llama.cpp, ~5 min on 2 cores) or "
                "`CMAKE_ARGS=\"-DGGML_NATIVE=ON\" pip install llama-cpp-python==0.3.36`; or use engine=transformers")


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def converted_path(src: Path, fmt: str) -> Path:
    """Where `convert` caches `src` in format `fmt` (the source file itself for gguf)."""
    if FORMATS[fmt] is None:
        return src
    import llama_cpp  # optional extra: loads the native library

    return cache_root() / "gguf" / f"{src.stem}-{fmt}-{short_hash(file_key(src), llama_cpp.__version__)}.gguf"


def convert(src: Path, fmt: str, threads: int) -> Path:
    """The GGUF in llama.cpp format `fmt`, converted once and cached (atomic rename)."""
    if FORMATS[fmt] is None:
        return src
    reader = gguf_meta.read(src)
    field = reader.fields.get("general.file_type")
    if field is not None and int(field.parts[field.data[0]][0]) == FORMATS[fmt]:
        return src  # already in that format: a converted copy would only duplicate it on disk
    out = converted_path(src, fmt)
    n_weights = sum(int(t.n_elements) for t in reader.tensors)
    if out.is_file():
        return out
    with build_lock(out):  # another process converting the same file: wait for its result
        if out.is_file():
            return out
        return _convert(src, out, fmt, threads, n_weights)


def _convert(src: Path, out: Path, fmt: str, threads: int, n_weights: int) -> Path:
    import llama_cpp

    # a full disk makes llama.cpp fail with a bare code 1 after minutes of work: check first, in one line
    require_free(out.parent, n_weights * BYTES_PER_WEIGHT[fmt], f"converting {src.name} to {fmt}")
    tmp = out.with_suffix(f".tmp{os.getpid()}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FORMATS[fmt]
    params.nthread = threads
    params.allow_requantize = True  # the source is already quantized (e.g. Q4_1): dequantize, then convert
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise QuantbenchError(f"llama.cpp could not convert {src.name} to {fmt} (code {rc}); "
                              f"use engine.format=gguf")
    os.replace(tmp, out)
    return out


def sixteen_format(device: str, threads: int = 0) -> str:
    """engine.format=auto16: F16 or BF16, as quantizer=auto16 (with its default measure.gemv) picks on this CPU at
    the run's thread count."""
    kernel = gemv_choice("auto", device, env.cpu_info())[0]
    return {"float16": "F16", "bfloat16": "BF16"}[sixteen_choice(device, kernel, threads)[0]]


@dataclass
class LlamaCppEngine:
    """Run the model's GGUF through llama.cpp (see module docstring)."""

    format: str = "gguf"  # gguf (as shipped) | F32 | BF16 | F16 | Q8_0 | Q4_0 | Q4_1 | auto16 (BF16 or F16 as quantizer=auto16)
    n_batch: int = 512  # llama.cpp logical batch for prompt processing
    kv_type: str = "f16"  # llama.cpp's default KV cache type (2 bytes per element; roofline counts it)
    flash_attn: bool = False  # llama.cpp's flash attention, set alike in-process and for llama-server (-fa on|off)

    def __post_init__(self) -> None:
        problems = [e for e in (one_of("engine.format", self.format, [*FORMATS, "auto16"]),
                                one_of("engine.kv_type", self.kv_type, ("f16",))) if e]
        if not isinstance(self.n_batch, int) or self.n_batch <= 0:
            problems.append(f"engine.n_batch={self.n_batch!r} must be > 0")
        if not isinstance(self.flash_attn, bool):
            problems.append(f"engine.flash_attn={self.flash_attn!r} must be true or false")
        if problems:
            raise ConfigError(problems)

    @property
    def name(self) -> str:
        return "llama_cpp"

    @property
    def label(self) -> str:
        return f"llama.cpp {self.format}"

    def check_with(self, *, parts: dict, measure: Any, accuracy: Any) -> None:
        """llama.cpp runs the GGUF's own (or a converted llama.cpp) format: no quantbench quantizer."""
        q = parts.get("quantizer")
        if q is not None and getattr(q, "name", "") != "none":
            raise QuantbenchError(
                f"engine=llama_cpp runs llama.cpp formats, not quantbench quantizers: quantizer={q.name} is not "
                f"allowed; use quantizer=none and pick the format with engine.format=<{'|'.join(FORMATS)}>")
        model = parts.get("model")
        try:
            has_gguf = model is not None and model.gguf_path is not None
        except QuantbenchError:
            has_gguf = True  # the file is missing: preflight says how to get it
        if not has_gguf:
            raise QuantbenchError(f"engine=llama_cpp needs a GGUF model; model {getattr(model, 'name', '?')} has "
                                  "none: use model=smollm2_135m or model=gguf model.path=/path/to/model.gguf")
        strategy = parts.get("strategy")
        if strategy is not None and (not strategy.supports_llama_cpp or strategy.batch_size != 1):
            raise QuantbenchError(f"engine=llama_cpp decodes greedily at batch 1; strategy={strategy.name} is not "
                                  "supported: use strategy=greedy")
        if measure is not None and (measure.compile is True or measure.cache == "static"):
            raise QuantbenchError("engine=llama_cpp has its own kernels and KV cache: measure.compile and "
                                  "measure.cache=static apply to engine=transformers only")
        if measure is not None and (odd := set_apart(measure, TRANSFORMERS_ONLY)):
            raise QuantbenchError(f"engine=llama_cpp: {', '.join(odd)} applies to engine=transformers only; leave it "
                                  "at its default (measure.path/gemv/hugepages and the measure.compile_* settings; "
                                  "auto passes)")
        if measure is not None and model is not None:
            workloads.check(model, measure, strategy)  # prompt file, lengths vs the GGUF's context_length

    def preflight(self, exp: Experiment, device: str) -> None:
        if not available():
            raise QuantbenchError(INSTALL_HINT)
        if device != "cpu":
            raise QuantbenchError(f"engine=llama_cpp is built for CPU here (device {device}); "
                                  "use measure.device=cpu")
        exp.model.preflight()
        if self.format == "auto16":  # the 16-bit format quantizer=auto16 picks on this CPU (harness/measure/one_row.py)
            self.format = sixteen_format(device, exp.measure.threads)
        path = exp.model.gguf_path
        if path is None or not (Path(path).is_file() or exp.model.builds_gguf):  # random weights: written at load
            raise QuantbenchError(f"engine=llama_cpp: GGUF file {path} not found")

    def memory_estimate(self, exp: Experiment, device: str) -> Any:
        """The peak this run needs (harness/measure/memory.py): the format's file, the KV cache of n_ctx, buffers."""
        src = Path(exp.model.gguf_path)
        converted = converted_path(src, self.format) if src.is_file() else None
        n_ctx, n_batch = self._context(exp)
        return memory.llama_cpp_estimate(exp, self.format, converted, n_ctx, n_batch)

    def _context(self, exp: Experiment) -> tuple[int, int]:
        """(n_ctx, n_batch) before the tokenizer runs: synthetic lengths are exact, text prompts bounded."""
        m, acc = exp.measure, exp.accuracy
        n_ctx = max(memory.context_positions(m, exp.model), acc.context_length if acc.enabled else 0)
        return n_ctx, self.batches(exp)[0]

    def batches(self, exp: Experiment) -> tuple[int, int]:
        """(n_batch, n_ubatch) for llama.cpp: a perplexity window is one decode of accuracy.context_length
        positions, so n_batch grows to hold it; llama_decode splits it into ubatches of engine.n_batch."""
        acc = exp.accuracy
        return max(self.n_batch, acc.context_length if acc.enabled else 0), self.n_batch

    def open(self, exp: Experiment, device: str, threads: int) -> LlamaCppSession:
        """One run's state (harness/run/hooks.py); nothing loads until the pipeline asks."""
        return LlamaCppSession(self, exp, threads)


class LlamaCppSession(Session):
    """The llama.cpp engine's hooks: convert and load the GGUF, decode greedily at batch 1 (module docstring)."""

    def __init__(self, engine: LlamaCppEngine, exp: Experiment, threads: int):
        self.engine, self.exp, self.threads = engine, exp, threads
        self.label = engine.label
        self.llm: Any = None
        self.gguf: Path | None = None
        self.model_shape: ModelShape | None = None
        self.depth = 0

    def references(self, tokenizer: Any) -> Record:
        cfg = self.exp.accuracy
        if not cfg.enabled:
            return {}, {}
        accuracy.scored_ids(tokenizer, cfg)  # a corpus with no token to score: refused now
        if not cfg.kl:
            return {}, {}
        # no reference record is compared with llama.cpp's logits: say so, on the run too, rather than drop them
        log.warning("accuracy: engine=llama_cpp records perplexity only, no KL divergence or top-1 agreement "
                    "(accuracy.kl=true is ignored; accuracy.kl=false silences this)")
        return {}, {"accuracy.kl": "unsupported (engine=llama_cpp)"}

    def load(self, tokenizer: Any, workload: Any, log_file: Path) -> Record:
        import llama_cpp  # optional extra (checked in preflight)

        exp, fmt, wl = self.exp, self.engine.format, workload
        self.eos = tokenizer.eos_token_id
        need = wl.depth + max(len(p) + lim for p, lim in zip(wl.prompts, wl.limits, strict=True))
        if exp.accuracy.enabled:
            need = max(need, exp.accuracy.context_length)
        metrics, tags = {}, {}
        t0 = measure.now()
        src = Path(exp.model.gguf_path)
        if not src.is_file():  # random weights: the float GGUF is written once per preset and seed (cached)
            exp.model.make_gguf()
            metrics["gguf_write_s"] = measure.now() - t0
        existed = converted_path(src, fmt).is_file()
        t1 = measure.now()
        with third_party_output(log_file):  # llama.cpp's quantizer lists every tensor: to the log file
            self.gguf = gguf = convert(src, fmt, self.threads)
        fresh = gguf != src and not existed  # the source file itself (gguf, or already in fmt) is no conversion
        if fresh:
            metrics["quantize_s"] = measure.now() - t1  # llama.cpp's own quantizer (llama_model_quantize)
        tags["gguf_cache"] = "miss" if fresh or "gguf_write_s" in metrics else "hit"
        tags["engine.format"] = fmt
        n_batch, n_ubatch = self.engine.batches(exp)
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=need, n_batch=n_batch, n_ubatch=n_ubatch,
                                   n_threads=self.threads, n_threads_batch=self.threads, logits_all=False,
                                   flash_attn=self.engine.flash_attn, seed=exp.measure.seed, verbose=False)
        tags.update(build_tags(n_batch, n_ubatch, self.engine.flash_attn))
        metrics["load_s"] = measure.now() - t0
        self.n_vocab = self.llm.n_vocab()
        if max(max(p) for p in wl.prompts + [wl.context or [0]]) >= self.n_vocab:
            raise QuantbenchError(f"the HF tokenizer produced ids >= llama.cpp's vocabulary ({self.n_vocab}); the "
                                  "GGUF and its tokenizer do not match")
        self.model_shape = shape_from_gguf(gguf)
        metrics.update({"weight_bytes": self.model_shape.weight_bytes, "params": gguf_params(gguf),
                        "bits_per_weight": linear_bits(gguf)})
        tags["kernel_path"] = f"llama.cpp[{fmt}:{gguf.name}]"
        return metrics, tags

    def prepare(self, opts: Any, workload: Any, batches: list, log_file: Path) -> Record:
        self.depth = workload.depth
        if self.depth:  # measure.context_depth: prefilled once, untimed; every call starts on top of it
            self.llm.reset()
            self.llm.eval(workload.context)
        return {}, {}

    def _logits_last(self) -> np.ndarray:
        """The last position's logits, read directly (see module docstring)."""
        import llama_cpp  # optional extra

        row = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(row, shape=(self.n_vocab,))

    def generate(self, batch: list[list[int]], opts: Any) -> measure.Generation:
        """Greedy decoding of one prompt (llama.cpp runs batch 1: check_with), timed like strategies/decode.py."""
        (prompt,) = batch
        llm, limit = self.llm, opts.max_new_tokens
        llm.reset()  # eval drops KV positions >= n_tokens: the cache starts empty ...
        llm.n_tokens = self.depth  # ... or holds exactly the depth context
        t0 = measure.now()
        llm.eval(prompt)
        tok = int(self._logits_last().argmax())
        t_first = measure.now()  # the first token is on the host: the decode phase's wall clock starts here
        seq, steps = [tok], []
        for _ in range(limit - 1):
            if opts.stop_at_eos and tok == opts.eos_token_id:
                break
            t = measure.now()
            llm.eval([tok])
            tok = int(self._logits_last().argmax())
            dt = measure.now() - t
            if opts.inject_slowdown > 0 or opts.inject_work > 0:  # test-only: a slower step, inside the timing
                dt = injected_step(opts, t, dt)  # spin-wait or real extra work (strategies/inject.py)
            steps.append(dt)
            seq.append(tok)
        decode_wall = measure.now() - t_first if steps else 0.0  # steps plus the host work between them
        return measure.Generation(sequences=[seq], prompt_tokens=len(prompt), ttft_s=t_first - t0, step_s=steps,
                                  decode_tokens=len(steps), decode_wall_s=decode_wall)

    def shape(self) -> ModelShape:
        return self.model_shape

    def score(self, tokenizer: Any) -> dict[str, float]:
        cfg = self.exp.accuracy
        ids = accuracy.corpus_tokens(tokenizer, cfg.corpus, cfg.max_tokens)
        return perplexity(self.llm, ids, cfg)

    def task_lm(self, tokenizer: Any) -> Any:
        """lm-eval over the same GGUF and token ids as engine=transformers (harness/run/llama_cpp_lm.py)."""
        self.close()  # the LM opens its own context per request set: free this one first
        return llama_cpp_lm.lm_class()(self.gguf, tokenizer, self.threads, self.engine.flash_attn)

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()  # frees the context and the model now, not whenever the GC runs
            self.llm = None
            gc.collect()


def system_info(raw: bytes | str) -> str:
    """`llama_print_system_info()` trimmed to the features it reports on: 'CPU: AVX2 FMA ...' (flags set to 1)."""
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
    parts, backend = [], ""
    for item in (p.strip() for p in text.split("|")):
        name, _, value = (x.strip() for x in item.rpartition("="))
        if ":" in name:  # 'CPU : SSE3' opens a backend's list
            backend, name = (x.strip() for x in name.split(":", 1))
            parts.append(f"{backend}:")
        if name and value not in ("", "0"):
            parts.append(name)
    return " ".join(parts)


def build_tags(n_batch: int, n_ubatch: int, flash_attn: bool) -> dict[str, str]:
    """Which llama.cpp ran and how: the library's version and CPU features, the batch sizes, the attention path."""
    import llama_cpp  # optional extra

    return {"llama.version": llama_cpp.__version__, "llama.system_info": system_info(llama_cpp.llama_print_system_info()),
            "llama.n_batch": str(n_batch), "llama.n_ubatch": str(n_ubatch), "llama.flash_attn": str(flash_attn).lower()}


def gguf_params(path: Path) -> float:
    """Logical parameter count: every tensor's elements (a tied output projection has no tensor)."""
    return float(sum(int(t.n_elements) for t in gguf_meta.read(path).tensors))


def linear_bits(path: Path) -> float:
    """Stored bits per weight over the transformer blocks' matrices (as the quantizer audit counts them)."""
    mats = [t for t in gguf_meta.read(path).tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return 8.0 * sum(int(t.n_bytes) for t in mats) / sum(int(t.n_elements) for t in mats)


def perplexity(llm: Any, ids: list[int], cfg: Any) -> dict[str, float]:
    """Perplexity over the same windows and scoring rule as `harness.analysis.accuracy.score`."""
    import llama_cpp  # optional extra

    n_vocab = llm.n_vocab()
    ctx = llm._ctx.ctx
    nll, n = 0.0, 0
    for begin, end, n_new in accuracy.spans(len(ids), cfg):
        window = ids[begin:end]
        llm._ctx.kv_cache_clear()
        llm.reset()
        llm._batch.set_batch(batch=window, n_past=0, logits_all=True)  # logits at every position
        llm._ctx.decode(llm._batch)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(len(window), n_vocab))
        rows = logits[-n_new - 1:-1].astype(np.float64)
        mx = rows.max(-1, keepdims=True)
        logz = (mx[:, 0] + np.log(np.exp(rows - mx).sum(-1)))
        target = np.asarray(window[-n_new:])
        nll += float((logz - rows[np.arange(n_new), target]).sum())
        n += n_new
    return {"perplexity": float(np.exp(nll / n)), "scored_tokens": float(n)}

