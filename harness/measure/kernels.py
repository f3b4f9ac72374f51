"""Which matmul kernel really ran: a short torch.profiler pass over decode steps, outside the timing.

The speed of a weight format on CPU is mostly the speed of the kernel its linear layers reach, and the
same quantizer can reach very different ones (torchao int8 weight-only dequantizes and calls `aten::mm`
in eager mode, but runs `aten::_weight_int8pack_mm` once inductor rewrites it). So after the timed
region each run decodes a few more tokens of its first batch under torch.profiler, starting after the
prefill (the `choose` hook of the decode loop fires after every forward), and records the linear-like
operator with the most self CPU time *in the body layers* as tag `kernel.linear` (e.g.
`aten::_weight_int4pack_mm_for_cpu`): a dispatcher op (`ns::name`, never a Python autograd.Function such as
bitsandbytes' MatMul8bitLt), the innermost one (not aten::linear over aten::mm), one that every body layer calls
where there is one; with its share of the profiled decode time (`kernel.linear_share`,
also metric `kernel_linear_share`) and its calls per step. The output projection is tagged apart
(`kernel.lm_head`, `kernel.lm_head_share`): quantizers leave it (often tied to the embedding) in 16 bits,
and where the int kernels are fast (Zen 5) its one big bf16 matmul outweighs all the body's int matmuls
of a small model, so a single "dominant op" would read `aten::mm` and tell a reader that int4 fell back
to a dequantized path when it did not. Ops are told apart by shape: the output projection's operands
carry the vocabulary dimension (the output embedding's row count), which no body layer has, or the
exact shape of a tensor the head holds (quantizers/rows8.py's tiled copy). A strategy that never calls the hook
(its own loop) is profiled whole, prefill included (tag `kernel.profiled=whole generation ...`, `whole_scope`), through
its `profiled_generate` where it has one: the generation the timing measures without the work a generate call runs
beside it (speculative decoding's greedy reference, which doubled the profiled linear calls per step).

On a CUDA model the same pass also records CUDA activity, and the tags come from the device kernels instead
(harness/measure/cuda_kernels.py): a compiled step replays a CUDA graph, so no ATen op shows on the host, but
CUPTI records the kernels the replay runs (`kernel.device=cuda`). Kernel rows have no shapes, so the output
projection is told apart by name: after the decode steps, `profile_head_kernels` profiles one eager call of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from harness.measure import cuda_kernels, sync

# torch.profiler is imported where used: only a profiled run needs it (tests/test_layout.py, LAZY_OK).

log = logging.getLogger("quantbench")

PROFILE_TOKENS = 4  # decode steps profiled (after one untimed prefill)
# substrings of operator names that do a linear layer's matmul (ATen, quantization libraries, ZenDNN)
LINEAR_OPS = ("mm", "linear", "gemm", "gemv", "matmul", "int8pack", "int4pack", "woq", "qlinear", "bitsandbytes",
              "quanto", "zentorch", "mkldnn", "onednn")
COMPILED_UNSEEN = "not visible (compiled region, e.g. a CUDA graph replay)"
NOT_LINEAR = ("bmm", "attention", "sdpa", "Torch-Compiled", "CompiledFxGraph", "## ", "cache", "Lookup")
# a linear layer's helpers, not its matmul: bitsandbytes int8 quantizes the activations and rescales the output
# around aten::_int_mm, and those took more self time than the matmul itself
HELPERS = ("vectorwise_quant", "double_quant", "dequant", "quantize_")


def is_linear_op(name: str) -> bool:
    low = name.lower()
    return any(k in low for k in LINEAR_OPS) and not any(k.lower() in low for k in NOT_LINEAR)


Event = tuple  # (name, self CPU us, calls) or (name, self CPU us, calls, input shapes)


def _touches(shapes: Any, dim: int) -> bool:
    """Whether any operand shape (a list of lists of ints, possibly nested) has `dim` as a dimension."""
    if isinstance(shapes, int):
        return shapes == dim
    return isinstance(shapes, (list, tuple)) and any(_touches(s, dim) for s in shapes)


def _shapes(shapes: Any) -> list[tuple[int, ...]]:
    """Every operand shape (a list of ints) in `shapes`, however nested."""
    if isinstance(shapes, (list, tuple)) and shapes and all(isinstance(d, int) for d in shapes):
        return [tuple(shapes)]
    return [t for s in shapes for t in _shapes(s)] if isinstance(shapes, (list, tuple)) else []


def _head(shapes: Any, vocab: int, held: frozenset[tuple[int, ...]] = frozenset()) -> bool:
    """Whether an op's operands are the output projection's: a dimension of `vocab` rows, or exactly the shape of a
    tensor the head holds (`held`: quantizers/rows8.py's tiles of it, [vocab/4, K/32, 128] and such). A rule on
    tile shapes alone counted body layers of vocab/4 rows as the head (their own tiles are [N/4, K/32, 128])."""
    return _touches(shapes, vocab) or any(s in held for s in _shapes(shapes))


def _by_name(events: list[Event]) -> list[tuple[str, float, int]]:
    """Sum rows of one op name (the profiler splits them by operand shape) into (name, us, calls)."""
    acc: dict[str, list[float]] = {}
    for e in events:
        row = acc.setdefault(e[0], [0.0, 0])
        row[0] += e[1]
        row[1] += e[2]
    return [(n, t, int(c)) for n, (t, c) in acc.items()]


def kernel_candidate(name: str, wrappers: frozenset[str] = frozenset()) -> bool:
    """A linear op that can name the kernel: a dispatcher op (`ns::name`; Python autograd.Function records such as
    bitsandbytes' MatMul8bitLt or quanto's WeightQBytesLinearFunction have no namespace), not a helper, and not
    one of `wrappers` (ops that only call another linear op: `wrapper_names`)."""
    low = name.lower()
    return is_linear_op(name) and "::" in name and not any(k in low for k in HELPERS) and name not in wrappers


def wrapper_names(events: Any) -> frozenset[str]:
    """Names of linear ops that, every time they ran, called another candidate op below them (aten::linear over
    aten::mm, bitsandbytes::int8_linear_matmul over aten::_int_mm): the innermost op is the kernel. `events`:
    torch.profiler's FunctionEvents (with `cpu_children`)."""
    def below(e: Any) -> bool:
        return any(kernel_candidate(c.name) or below(c) for c in e.cpu_children)

    seen: dict[str, bool] = {}
    for e in events:
        if kernel_candidate(e.name):
            seen[e.name] = seen.get(e.name, True) and below(e)
    return frozenset(n for n, wraps in seen.items() if wraps)


def _dominant(events: list[Event], total: float, steps: int, tag: str, metric: str,
              wrappers: frozenset[str] = frozenset(), layers: int = 0) -> dict[str, Any]:
    linear = [e for e in _by_name(events) if kernel_candidate(e[0], wrappers)]
    # an op that runs in every one of the `layers` linear layers at each step names their kernel: bitsandbytes
    # int8's aten::addmm over the outlier columns of one layer took more self time than all its aten::_int_mm calls
    linear = [e for e in linear if e[2] / max(steps, 1) >= layers] or linear
    if not linear or total <= 0:
        if any(e[0].startswith("Torch-Compiled Region") or "cudagraph" in e[0].lower() for e in events):
            # a CUDA graph replays its kernels with no ATen call on the host (the H200 check's compiled
            # reduce-overhead rows): the kernel is not missing, the CPU-side profile cannot see it
            return {tag: COMPILED_UNSEEN}
        return {tag: "none found"}
    name, self_us, calls = max(linear, key=lambda e: e[1])
    return {tag: name, f"{tag}_share": f"{self_us / total:.0%}",
            f"{tag}_calls_per_step": str(round(calls / max(steps, 1))),
            f"{metric}_share": self_us / total, f"{metric}_ms_per_step": self_us / 1e3 / max(steps, 1)}


def dominant_linear(events: list[Event], steps: int, vocab: int | None = None,
                    held: frozenset[tuple[int, ...]] = frozenset(), wrappers: frozenset[str] = frozenset(),
                    layers: int = 0) -> dict[str, Any]:
    """The body layers' linear op with the most self time (`kernel.linear`, a `kernel_candidate`; one called by
    each of the body's `layers` linear layers per step where there is one) and its share of all profiled time; with
    `vocab` (and `held`: `head_shapes`) and shaped rows, the output projection's op apart (`kernel.lm_head`)."""
    total = sum(e[1] for e in events)
    if vocab:
        head = [e for e in events if len(e) > 3 and _head(e[3], vocab, held)]
        body = [e for e in events if not (len(e) > 3 and _head(e[3], vocab, held))]
    else:
        head, body = [], events
    found = _dominant(body, total, steps, "kernel.linear", "kernel_linear", wrappers, layers)
    if vocab:
        found.update(_dominant(head, total, steps, "kernel.lm_head", "kernel_lm_head", wrappers))
    return found


def vocab_rows(model: Any) -> int | None:
    """Rows of the output projection (the vocabulary): the dimension that marks its matmul in a profile."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return getattr(getattr(model, "config", None), "vocab_size", None)


def body_linears(model: Any) -> int:
    """Linear layers of the model but its output projection (modules with in/out features, outermost only)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names: list[str] = []
    for name, m in model.named_modules() if hasattr(model, "named_modules") else ():
        if m is head or not all(isinstance(getattr(m, a, None), int) for a in ("in_features", "out_features")):
            continue
        if not any(name.startswith(f"{p}.") for p in names):
            names.append(name)
    return len(names)


def head_shapes(model: Any) -> frozenset[tuple[int, ...]]:
    """Shapes of the tensors the output projection holds in more than one dimension (its own tiled copy under
    measure.gemv=rows8): an operand of exactly such a shape is the head's."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return frozenset()
    return frozenset(tuple(t.shape) for t in [*head.parameters(), *head.buffers()] if t.dim() > 1)


def profile_head_kernels(model: Any, rows: int) -> frozenset[str]:
    """On CUDA: the linear kernels one eager call of the output projection launches on `rows` rows (the decode
    step's batch), so that the step's profile can tell its kernel apart (harness/measure/cuda_kernels.py)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2 or weight.device.type != "cuda":
        return frozenset()
    dtype = weight.dtype if weight.dtype.is_floating_point else getattr(model, "dtype", torch.float16)
    x = torch.zeros(rows, 1, weight.shape[1], dtype=dtype, device=weight.device)
    try:
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            head(x)
            sync("cuda")
        return cuda_kernels.head_kernels(cuda_kernels.device_rows(prof.key_averages()))
    except Exception as exc:  # noqa: BLE001 - a side measurement: the tag then says it was not profiled apart
        log.warning("output projection profile failed: %s", exc)
        return frozenset()


def model_device(model: Any) -> str:
    """The device type of the model's first parameter ("cpu" without any)."""
    params = model.parameters() if hasattr(model, "parameters") else iter(())
    first = next(iter(params), None)
    return first.device.type if first is not None else "cpu"


def whole_scope(strategy: Any, tokens: int) -> str:
    """Tag `kernel.profiled` of a whole-generation profile: what ran under the profiler, and what its per-step
    values are (the profile's totals over `tokens`: the prefill and each row's decode steps are not told apart)."""
    part = getattr(strategy, "profiled_part", "")  # a strategy's `profiled_generate` says what it leaves out
    return (f"whole generation, prefill included ({tokens + 1} tokens a row; per step = total / {tokens})"
            + (f": {part}" if part else ""))


def profile_linear(strategy: Any, model: Any, batch: list[list[int]], opts: Any,
                   tokens: int = PROFILE_TOKENS) -> tuple[dict[str, str], dict[str, float]]:
    """Profile `tokens` decode steps of one generation of `batch`; returns (tags, metrics).

    At most the run's own length (`opts.max_new_tokens`): a compiled path's static cache is sized for the run's
    prompts and tokens, and a longer profile failed on it ("needs 37 cache slots ... sized for 36").
    """
    from torch.profiler import ProfilerActivity, profile

    tokens = max(1, min(tokens, opts.max_new_tokens - 1))

    on_cuda = model_device(model).startswith("cuda")
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    prof = profile(activities=activities, record_shapes=True)
    state = {"started": False, "steps": 0}

    def choose(logits: Any, index: int) -> Any:
        if index == 0 and not state["started"]:  # the prefill forward is done: decode steps from here
            if on_cuda:  # the prefill's kernels may still run: let them finish outside the profiled steps
                sync("cuda")
            prof.start()
            state["started"] = True
        elif state["started"]:
            state["steps"] += 1
        return logits.argmax(-1)

    whole = not strategy.stepwise  # a capability (strategies/base.py): only decode.py's loop calls `choose`
    try:
        if not whole:
            short = dataclasses.replace(opts, max_new_tokens=tokens + 1, choose=choose)
            strategy.generate(model, batch, short)
            whole = not state["started"]
        if whole:  # the strategy runs its own loop: profile the whole (short) generation
            short = dataclasses.replace(opts, max_new_tokens=tokens + 1)
            # the measured generation alone where generate() runs more beside it (speculative's greedy reference)
            run = getattr(strategy, "profiled_generate", strategy.generate)
            prof.start()
            run(model, batch, short)
            state["steps"] = tokens
        prof.stop()
    except Exception as exc:  # noqa: BLE001 - a profile that fails must not fail the measured run
        with contextlib.suppress(Exception):
            prof.stop()
        log.warning("kernel profile failed: %s", exc)
        return {"kernel.linear": f"profile failed: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"}, {}
    if log.isEnabledFor(logging.DEBUG):  # the whole profile table: run.py ... hydra.verbose=quantbench
        by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        log.debug("decode-step profile:\n%s", prof.key_averages().table(sort_by=by, row_limit=20))
    if on_cuda:  # the device kernels name the linear layers' kernel, graph replays included
        found = cuda_kernels.dominant_cuda_kernel(cuda_kernels.device_rows(prof.key_averages()),
                                                  state["steps"] or tokens, profile_head_kernels(model, len(batch)))
    else:
        events = [(e.key, float(e.self_cpu_time_total), int(e.count), e.input_shapes)
                  for e in prof.key_averages(group_by_input_shape=True)]
        found = dominant_linear(events, state["steps"] or tokens, vocab_rows(model), head_shapes(model),
                                wrapper_names(prof.events()), body_linears(model))
    tags = {k: v for k, v in found.items() if k.startswith("kernel.")}
    tags["kernel.profiled"] = whole_scope(strategy, tokens) if whole else f"{state['steps'] or tokens} decode steps"
    metrics = {k: v for k, v in found.items() if not k.startswith("kernel.")}
    log.info("kernel.linear=%s (%s of profiled decode time), output projection %s (%s)", tags["kernel.linear"],
             tags.get("kernel.linear_share", "?"), tags.get("kernel.lm_head", "?"), tags.get("kernel.lm_head_share", "?"))
    return tags, metrics
