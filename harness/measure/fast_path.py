"""The fast decode path: `measure.compile=true` compiles the decode step with torch.compile.

Why it exists: eager PyTorch spends most of a small model's decode step in Python and per-op dispatch,
so an eager benchmark measures overhead, not the bytes a weight format saves (see docs/fast_path.md).

How it keeps measurements true:
- Shapes are fixed. Decode steps need a static KV cache (`measure.cache=static`; `compile=true` with a
  dynamic cache is a config error) whose length is fixed for the whole run: the longest prompt of the
  prompt set plus `max_new_tokens`. One cache per batch size is reused (reset) across generations, so
  its tensors keep their addresses (CUDA graphs need that). The growing 2D attention mask is padded
  to that fixed length before each compiled call. Prefill stays eager (its length varies per prompt).
- Compilation happens before timing. `compile_warmup` runs every batch of the run once through the
  compiled path; the wall time of the decode steps during which dynamo compiled is `compile_s`, a
  separate metric that never enters the timed decode.
- Recompilation while timing fails the run: the timed region runs under
  `torch.compiler.set_stance("fail_on_recompile")` and dynamo's graph counters are compared before
  and after as a second check.
- Correctness: after timing, every batch is decoded once more with the same step uncompiled (same
  fixed-length static cache, same padded mask) and the tokens are compared with the compiled run's:
  `compiled_match` is 1 when they are identical, else 0. A difference is then explained or not:
  eager is replayed with the compiled tokens forced, and at every position where they differ the
  eager logit of the compiled token must lie within NEAR_TIE_ULPS units in the last place (of the
  logits' dtype, at the top logit's magnitude) of the eager maximum. Why: in bf16 inductor's fused
  kernels round differently from eager (logits measured up to 5 ulps apart on SmolLM2), so where eager's
  top two logits are 1-2 ulps apart greedy can flip, and from there the two continuations differ
  entirely; a miscompiled step (wrong cache slot, wrong mask) instead picks tokens far below eager's
  maximum. `measure.compile_match=near_tie` (default) fails the run only on such unexplained
  differences and records `compiled_tie_flips` and `compiled_max_gap_ulps`; `strict` fails on any
  difference. fp32 compiled runs matched exactly here.

On CUDA `compile_mode=reduce-overhead` wraps the compiled graph in CUDA graphs (torch's cudagraph
trees): each step is one graph replay, inputs are copied into static buffers, the KV cache tensors are
marked static by transformers' StaticCache, and `torch.compiler.cudagraph_mark_step_begin()` marks
each decode step so an output is never read after the next replay overwrote it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import torch

from harness import env, measure  # env.cpu_info looked up per call: tests patch it
from harness.config import COMPILE_MODES
from harness.errors import QuantbenchError
from harness.measure import cuda_kernels, near_tie
from harness.measure.near_tie import NEAR_TIE_ULPS, ulp  # noqa: F401 - shared with speculative decoding; ulp re-exported
from harness.measure.near_tie import first_diff as _first_diff

# transformers' attention internals and zentorch (optional) are imported where used: only a compiled run needs them
# (tests/test_layout.py, LAZY_OK).

log = logging.getLogger("quantbench")


def graph_count() -> int:
    """Graphs dynamo has compiled in this process (grows by one per compile or recompile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_blocker(quantizer: Any, device: str) -> str:
    """Why `quantizer` cannot be compiled on `device` ("" when it can)."""
    hook = getattr(quantizer, "compile_blocker", None)
    if hook is not None:
        return hook(device) or ""
    return "" if getattr(quantizer, "compilable", True) else f"quantizer {quantizer.name} is not compilable"


def preflight(exp: Any, device: str) -> str:
    """Before loading: which path will run ("compiled", "eager", "eager-fallback"); raise if impossible."""
    m = exp.measure
    if not m.compile:
        return "eager"
    if not exp.strategy.stepwise:  # a capability (strategies/base.py): the compiled step is decode.py's
        raise QuantbenchError(f"measure.compile=true compiles the decode step of strategies/decode.py, and strategy "
                              f"{exp.strategy.name} runs its own loop; drop measure.compile or use strategy=greedy")
    if device == "cpu" and not env.cxx_compiler():
        raise QuantbenchError("measure.compile=true on CPU needs a C++ compiler (torch inductor compiles C++ kernels); "
                              "apt-get install g++ (scripts/setup.sh does), or drop measure.compile")
    backend_problem = backend_blocker(m.compile_backend, device)
    if backend_problem:
        raise QuantbenchError(backend_problem)
    reason = compile_blocker(exp.quantizer, device)
    if not reason:
        return "compiled"
    if m.compile_fallback:
        log.warning("measure.compile=true but %s; running eager (measure.compile_fallback=true)", reason)
        return "eager-fallback"
    raise QuantbenchError(f"measure.compile=true but {reason}; drop measure.compile, pick a compilable quantizer "
                          "(docs/fast_path.md), or set measure.compile_fallback=true to run it eager")


def backend_blocker(backend: str, device: str) -> str:
    """Why `measure.compile_backend=backend` cannot run on `device` ("" when it can).

    zentorch (AMD's ZenDNN plugin, `pip install zentorch==2.13.0.2` for torch 2.13) registers the
    torch.compile backend "zentorch"; its graph rewrites run only on CPUs with AVX-512 (it checks
    `zentorch._C.is_avx512_supported()` and otherwise hands the graph to plain inductor), so on an AVX2
    CPU it would measure inductor under another name: refused here instead.
    """
    if backend == "inductor":
        return ""
    if backend == "zentorch":
        if not device.startswith("cpu"):
            return "measure.compile_backend=zentorch is a CPU backend; use measure.compile_backend=inductor on " + device
        if importlib.util.find_spec("zentorch") is None:
            return ("measure.compile_backend=zentorch needs AMD's zentorch plugin (pip install zentorch==2.13.0.2, "
                    "matching torch 2.13); or use measure.compile_backend=inductor")
        if "avx512f" not in env.cpu_info().flags:
            return (f"measure.compile_backend=zentorch optimizes only on AVX-512 CPUs and this one is "
                    f"{env.cpu_info().isa} (zentorch would run plain inductor); use measure.compile_backend=inductor")
        return ""
    return f"measure.compile_backend={backend!r} is not allowed; choose one of: inductor, zentorch"


def inductor_options(mode: str, freezing: bool, cpp_wrapper: bool = False) -> dict[str, Any]:
    """torch.compile `options` for `mode`, plus eager-parity rounding and optional freezing.

    torch.compile accepts `mode` or `options`, not both, so the mode's own options are expanded here.
    `emulate_precision_casts`: inductor normally keeps fused bf16/fp16 intermediates in fp32 (more
    precise than eager, not equal to it); with it, fused kernels round where eager rounds, which removes
    one source of compiled-vs-eager differences (compiled_match). It cost nothing measurable here (bf16
    compiled step 20 ms either way). Freezing folds the weights into the graph as constants, which lets
    inductor prepack them for oneDNN on CPU. `cpp_wrapper` makes inductor call its kernels from generated
    C++ instead of a Python wrapper (less per-kernel overhead; longer compile).
    """
    from torch._inductor import list_mode_options

    options = {**list_mode_options(mode), "emulate_precision_casts": True}
    if freezing:
        options["freezing"] = True
    if cpp_wrapper:
        options["cpp_wrapper"] = True
    return options


PACKED_SDPA = "quantbench_sdpa_packed_gqa"


def _packed_gqa_sdpa(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, but decode steps pack the query groups also when compiled.

    For one query token with grouped KV heads, eager transformers reshapes the query heads that share a
    KV head into query rows (`pack_gqa`) so attention reads the KV cache once; under torch.compile it
    takes `repeat_kv` instead, which copies the whole cache `groups` times every step. On this CPU (bf16,
    batch 8, SmolLM2's 9 query / 3 KV heads) the same SDPA kernel took 246 us per call compiled vs 75 us
    eager, and the compiled batch-8 step lost 30% to eager. Same arithmetic, same kernel: only the copy
    goes away.
    """
    from transformers.integrations.sdpa_attention import pack_gqa, sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] == 1 and groups > 1 and (attention_mask is None or attention_mask.shape[1] == 1) \
            and not kwargs.get("dropout"):
        out = torch.nn.functional.scaled_dot_product_attention(pack_gqa(query, groups), key, value,
                                                               attn_mask=attention_mask, scale=kwargs.get("scaling"))
        return out.reshape(out.shape[0], -1, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def use_packed_gqa(model: Any) -> bool:
    """Switch an SDPA model with grouped KV heads to `_packed_gqa_sdpa`; False when it does not apply."""
    cfg = model.config
    if getattr(cfg, "_attn_implementation", None) not in ("sdpa", PACKED_SDPA):
        return False
    if getattr(cfg, "num_key_value_heads", None) in (None, getattr(cfg, "num_attention_heads", None)):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, _packed_gqa_sdpa)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    model.set_attn_implementation(PACKED_SDPA)
    return True


class FastPath:
    """A compiled decode step plus the fixed-size static caches it needs (see module docstring)."""

    def __init__(self, model: Any, *, device: str, max_cache_len: int, mode: str = "default",
                 freezing: bool = False, backend: str = "inductor", cpp_wrapper: bool = False,
                 skip_guards: bool = False):
        if mode not in COMPILE_MODES:
            raise QuantbenchError(f"measure.compile_mode={mode!r} is not allowed; choose one of: "
                                  + ", ".join(COMPILE_MODES))
        # Dynamo caches compiled code per code object with guards on the closed-over model; a sweep that
        # builds many models in one process would pile up recompiles until the recompile limit, after which
        # dynamo silently runs eager. Start each fast path from an empty cache instead.
        torch._dynamo.reset()
        self.packed_gqa = use_packed_gqa(model)  # before compiling: dynamo traces the attention it finds
        self.device, self.max_cache_len, self.mode = device, max_cache_len, mode
        self.cudagraphs = device.startswith("cuda") and mode == "reduce-overhead"
        if self.cudagraphs:
            cuda_kernels.init_profiler_for_cuda_graphs()
        self.compile_s = 0.0
        self.compiled_graphs = 0
        self._caches: dict[int, Any] = {}
        self._masks: dict[int, torch.Tensor] = {}
        self._timing = False
        self.skip_guards = skip_guards
        options = inductor_options(mode, freezing, cpp_wrapper)

        def step(ids, mask, pos, cache):
            out = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True,
                        logits_to_keep=1)
            return out.logits[:, -1, :]

        self._eager_step = step
        self.eager = False  # True: same caches and padded masks, uncompiled (the compiled_match reference)
        if backend == "zentorch":  # registers the backend; its own inductor pass (see backend_blocker)
            import zentorch  # noqa: F401

            self._compiled = torch.compile(step, backend="zentorch", fullgraph=False, dynamic=False)
        else:
            self._compiled = torch.compile(step, options=options, fullgraph=False, dynamic=False)

    def make_cache(self, model: Any, batch_size: int, max_len: int) -> Any:
        """The run's static cache for this batch size, reset (same tensors: stable addresses)."""
        from transformers import StaticCache

        if max_len > self.max_cache_len:
            raise QuantbenchError(f"a generation needs {max_len} cache slots but the compiled path was sized for "
                                  f"{self.max_cache_len}; the prompt set changed after compile_warmup")
        cache = self._caches.get(batch_size)
        if cache is None:
            cache = self._caches[batch_size] = StaticCache(config=model.config, max_cache_len=self.max_cache_len)
        else:
            cache.reset()
        return cache

    def step(self, model: Any, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any,
             cache_position: torch.Tensor) -> torch.Tensor:
        """One compiled decode step; the mask is padded to the fixed cache length (fixed shapes)."""
        bsz, cur = mask.shape
        full = self._masks.get(bsz)
        if full is None:
            full = self._masks[bsz] = torch.zeros((bsz, self.max_cache_len), dtype=mask.dtype, device=mask.device)
        full.zero_()
        full[:, :cur] = mask
        if self.eager:
            return self._eager_step(ids, full, pos, cache)
        if self.cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        before = graph_count()
        t0 = measure.now()
        logits = self._compiled(ids, full, pos, cache)
        if self.cudagraphs:  # the graph's output buffer is reused by the next replay
            logits = logits.clone()
        if graph_count() != before:
            if self._timing:
                raise QuantbenchError("torch.compile recompiled the decode step inside the timed region; the "
                                      "warmup did not cover a shape the run uses (report this as a bug)")
            measure.sync(self.device)
            self.compile_s += measure.now() - t0
            self.compiled_graphs += graph_count() - before
        return logits

    @contextlib.contextmanager
    def timing(self):
        """The timed region: any recompilation raises instead of silently costing seconds."""
        self._timing = True
        before = graph_count()
        try:
            # skip_guards: dynamo then checks only the guards that tell its cached graphs apart (one per batch
            # size here), not the ~hundreds on the model's parameters and the cache, which cost 2-7 ms per
            # step on 2 Zen 3 cores. Safe only because nothing a guard watches changes between warmup and the
            # timed steps (same model, same caches, fixed shapes); compiled_match re-checks the tokens after.
            with torch.compiler.set_stance("fail_on_recompile", skip_guard_eval_unsafe=self.skip_guards):
                yield
        except RuntimeError as exc:
            if "recompil" in str(exc).lower() or "fail_on_recompile" in str(exc):
                raise QuantbenchError("torch.compile had to recompile the decode step inside the timed region "
                                      f"({str(exc).splitlines()[0][:200]}); the warmup did not cover a shape the "
                                      "run uses") from exc
            raise
        finally:
            self._timing = False
        if graph_count() != before:
            raise QuantbenchError(f"torch.compile compiled {graph_count() - before} graph(s) inside the timed region")


def max_cache_len(batches: list[list[list[int]]], max_new_tokens: int) -> int:
    """Fixed static-cache length for a run: the widest (left-padded) batch plus every new token."""
    return max(len(p) for b in batches for p in b) + max_new_tokens


def prepare(exp: Any, model: Any, opts: Any, batches: list[list[list[int]]], path: str) -> FastPath | None:
    """Build and compile the fast path for this run's batches; None when the run is eager."""
    if path != "compiled":
        return None
    m = exp.measure
    flags = quantizer_inductor(exp.quantizer, opts.device)
    with torch._inductor.config.patch(flags):  # dynamo compiles lazily: in the warmup's first calls
        fast = FastPath(model, device=opts.device, max_cache_len=max_cache_len(batches, opts.max_new_tokens),
                        mode=m.compile_mode, freezing=m.compile_freezing, backend=m.compile_backend,
                        cpp_wrapper=m.compile_cpp_wrapper, skip_guards=m.compile_skip_guards is True)
        fast.inductor = flags
        compile_warmup(exp.strategy, model, batches, opts, fast)
    return fast


def quantizer_inductor(quantizer: Any, device: str) -> dict[str, Any]:
    """The torch._inductor.config flags `quantizer`'s kernels need (its optional `inductor_config`, quantizers/base.py).
    `prepare` patches them in around this run's compile only: torchao sets them process-wide, which leaked into every
    later compile of a sweep (an fp16 baseline after an int8 cell compiled differently from one before it)."""
    import torch._inductor.config  # noqa: F401 - `prepare` patches it; `import torch` alone may not load it

    hook = getattr(quantizer, "inductor_config", None)
    flags = dict(hook(device) or {}) if hook is not None else {}
    if flags:
        log.info("inductor flags for this compile (tag compile.inductor): %s", flags)
    return flags


def compile_warmup(strategy: Any, model: Any, batches: list[list[list[int]]], opts: Any, fast: FastPath) -> None:
    """Run every batch once through the compiled path (compiles each decode shape; not timed)."""
    opts.fast_path = fast
    seen: set[int] = set()
    for batch in batches:
        if len(batch) in seen:  # decode-step shapes depend only on batch size (fixed cache length)
            continue
        seen.add(len(batch))
        strategy.generate(model, batch, opts)
    if fast.compiled_graphs == 0:
        raise QuantbenchError("measure.compile=true but no graph was compiled during the compile warmup; the "
                              "strategy does not use the shared decode loop (strategies/decode.py)")
    log.info("compiled the decode step (%s, %d graph(s)) in %.1f s", fast.mode, fast.compiled_graphs, fast.compile_s)


def near_tie_replay(strategy: Any, model: Any, batch: list[list[int]], opts: Any,
                    compiled: list[list[int]]) -> tuple[int, float]:
    """Replay eager with the compiled tokens forced; return (flips, largest gap in ulps) (harness.measure.near_tie)."""
    return near_tie.replay(lambda: strategy.generate(model, batch, opts), opts, compiled)


def check_match(strategy: Any, model: Any, batches: list[list[list[int]]], opts_for: Callable[[list], Any],
                timed: list[Any], policy: str = "near_tie") -> dict[str, float]:
    """Compare compiled with eager greedy tokens for every batch (module docstring); fail if unexplained.

    `opts_for(batch)` gives each batch the options it was timed with: with per-prompt max_new_tokens (a JSONL
    workload) a batch decodes its own length, and eager must decode that length too to be comparable.

    The eager reference runs the very same step uncompiled: same fixed-length static cache, same padded
    mask. Only compilation differs. (The plain eager loop sizes its cache per prompt; SDPA over a cache
    of another masked length may reduce in another order, which in bf16 can flip a near-tie greedy
    choice without compilation being involved.) Without a fast path it runs the plain eager loop.
    Returns the metrics `compiled_match` (1 identical, else 0), `compiled_tie_flips` and
    `compiled_max_gap_ulps`.
    """
    fast = opts_for(batches[0]).fast_path if batches else None  # one fast path, shared by every batch's options
    if fast is not None:
        fast.eager = True
    flips, worst, identical = 0, 0.0, True
    try:
        for batch, gen in zip(batches, timed, strict=False):
            opts = opts_for(batch)
            eager = strategy.generate(model, batch, opts)
            if eager.sequences == gen.sequences:
                continue
            identical = False
            row, at = _first_diff(eager.sequences, gen.sequences)
            a, b = eager.sequences[row], gen.sequences[row]
            where = (f"compiled greedy output differs from eager at token {at} of a generation (eager {a[at:at + 3]}, "
                     f"compiled {b[at:at + 3]}); compiled_match=0")
            if policy == "strict":
                raise QuantbenchError(f"{where} (measure.compile_match=strict)")
            n, gap = near_tie_replay(strategy, model, batch, opts, gen.sequences)
            flips, worst = flips + n, max(worst, gap)
            if n == 0:  # eager, made to follow the compiled tokens, never had to flip one: a cut or an extra token
                raise QuantbenchError(f"{where}; no near-tie flip explains it ({len(b)} tokens against eager's "
                                      f"{len(a)}): the compiled step computes something else")
            if gap > NEAR_TIE_ULPS:
                raise QuantbenchError(f"{where}: eager scores a compiled token {gap:.1f} ulps below its top choice "
                                      f"(more than the {NEAR_TIE_ULPS:g} a rounding flip of a near-tie can explain): "
                                      "the compiled step computes something else")
    finally:
        if fast is not None:
            fast.eager = False
    if not identical:
        log.warning("compiled greedy output differs from eager by %d near-tie flip(s) (largest eager gap %.1f ulps "
                    "<= %g): rounding, not a miscompile; compiled_match=0", flips, worst, NEAR_TIE_ULPS)
    return {"compiled_match": 1.0 if identical else 0.0, "compiled_tie_flips": float(flips),
            "compiled_max_gap_ulps": worst}
