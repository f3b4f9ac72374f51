"""The compiled fast path on the tiny model: same tokens as eager, compile time outside the timing,
recompilation inside the timing caught, non-compilable quantizers refused before loading."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from conftest import FAST

from harness.config import build
from harness.errors import ConfigError, QuantbenchError
from harness.measure import compile_diag, fast_path
from harness.measure.prompts import PROMPT_SETS
from harness.run import runner
from quantizers.dtype import Dtype
from strategies.base import DecodeOptions
from strategies.greedy import Greedy

NO_ACC = ["accuracy.enabled=false"]
COMPILED = ["measure.cache=static", "measure.compile=true"]
LIMITS = [8, 3, 8, 5]  # per-prompt max_new_tokens, the longest FAST's


@dataclass
class NotCompilable(Dtype):
    """A quantizer whose kernels torch.compile cannot trace (like bitsandbytes' custom ops)."""

    compilable = False

    def load(self, *args, **kwargs):  # pragma: no cover - reaching it is the failure under test
        raise AssertionError("a non-compilable quantizer must be refused before the model loads")


def test_compile_needs_static_cache_and_a_known_mode(compose):
    with pytest.raises(ConfigError, match="measure.cache=static"):  # an explicit dynamic cache is honoured: refused
        build(compose([*FAST, "measure.compile=true", "measure.cache=dynamic"]))
    build(compose([*FAST, "measure.compile=true"]))  # cache=auto becomes static (harness/measure/paths.py)
    with pytest.raises(ConfigError, match="measure.compile='sometimes'.*auto, true, false"):
        build(compose([*FAST, "measure.compile=sometimes"]))
    with pytest.raises(ConfigError, match="compile_mode.*choose one of: auto, default, reduce-overhead"):
        build(compose([*FAST, *COMPILED, "measure.compile_mode=fastest"]))
    build(compose([*FAST, *COMPILED, "measure.compile_mode=max-autotune-no-cudagraphs"]))
    with pytest.raises(ConfigError, match="compile_match.*near_tie, strict"):
        build(compose([*FAST, *COMPILED, "measure.compile_match=loose"]))
    assert build(compose([*FAST, *COMPILED, "measure.compile_match=strict"])).measure.compile_match == "strict"


def test_non_compilable_quantizer_fails_before_loading_or_falls_back_when_asked(compose):
    from harness.run.engines import TransformersEngine

    exp = build(compose([*FAST, *COMPILED, *NO_ACC]))
    exp.quantizer = NotCompilable(dtype="float32")
    with pytest.raises(QuantbenchError, match="cannot be compiled.*compile_fallback=true"):
        TransformersEngine().preflight(exp, "cpu")

    exp.measure.compile_fallback = True
    assert fast_path.preflight(exp, "cpu") == "eager-fallback"
    exp.measure.compile = False
    assert fast_path.preflight(exp, "cpu") == "eager"


def test_non_compilable_quantizer_run_stops_before_load(compose):
    exp = build(compose([*FAST, *COMPILED, *NO_ACC]))
    exp.quantizer = NotCompilable(dtype="float32")
    with pytest.raises(QuantbenchError, match="measure.compile=true but quantizer"):
        runner.execute(exp)


def test_mismatch_between_compiled_and_eager_fails_the_run():
    from harness.models import TinyRandom, load_pretrained

    model = load_pretrained(TinyRandom(), "float32", "cpu")
    opts = DecodeOptions(max_new_tokens=6, pad_token_id=0, cache="static")
    batches = [[[5, 6, 7]]]
    gens = [Greedy().generate(model, b, opts) for b in batches]
    assert fast_path.check_match(Greedy(), model, batches, lambda b: opts, gens)["compiled_match"] == 1.0
    gens[0].sequences[0][3] += 1  # what a miscompiled step would produce: a token far below eager's top
    with pytest.raises(QuantbenchError, match="differs from eager at token 3.*compiled_match=0.*ulps below"):
        fast_path.check_match(Greedy(), model, batches, lambda b: opts, gens)
    with pytest.raises(QuantbenchError, match="compile_match=strict"):
        fast_path.check_match(Greedy(), model, batches, lambda b: opts, gens, policy="strict")
    gens[0].sequences[0][3] -= 1
    gens[0].sequences[0].pop()  # a compiled run cut short: eager made to follow it never flips, no gap to measure
    with pytest.raises(QuantbenchError, match="no near-tie flip explains it .5 tokens against eager's 6"):
        fast_path.check_match(Greedy(), model, batches, lambda b: opts, gens)


def test_the_check_decodes_each_batch_at_the_length_it_was_timed_with():
    """Per-prompt max_new_tokens (a JSONL workload): eager decodes each batch's own length, as the timed run did;
    at the run's longest length every shorter batch "differed" (a false compiled_match=0, a failed strict run)."""
    from harness.measure.workloads import Workload
    from harness.models import TinyRandom, load_pretrained

    model = load_pretrained(TinyRandom(), "float32", "cpu")
    wl = Workload(kind="file", prompts=[[5, 6, 7, 8], [9, 10, 11]], limits=[4, 8], context=[], texts=["a", "b"])
    opts_for = wl.opts_for(DecodeOptions(max_new_tokens=wl.max_new_tokens, pad_token_id=0))
    batches = Greedy().batches(wl.prompts)
    gens = [Greedy().generate(model, b, opts_for(b)) for b in batches]
    assert sorted(len(g.sequences[0]) for g in gens) == [4, 8]
    assert fast_path.check_match(Greedy(), model, batches, opts_for, gens, policy="strict") == \
        {"compiled_match": 1.0, "compiled_tie_flips": 0.0, "compiled_max_gap_ulps": 0.0}


class OneStep(Greedy):
    """One token from fixed bf16 logits [4.0, 4.0 - 1 ulp, 0.0]: eager's argmax is token 0."""

    def generate(self, model, batch, opts):
        from harness.measure import Generation

        logits = torch.tensor([[4.0, 4.0 - 0.03125, 0.0]], dtype=torch.bfloat16)  # bf16 ulp at 4 = 2^-7 x 4
        nxt = logits.argmax(-1) if opts.choose is None else opts.choose(logits, 0)
        return Generation(sequences=[[int(nxt[0])]], prompt_tokens=1, ttft_s=0.0, step_s=[], decode_tokens=0)


def test_near_tie_flip_is_recorded_not_failed_and_a_far_token_fails():
    from harness.measure import Generation

    opts = DecodeOptions(max_new_tokens=1, cache="static")
    flipped = [Generation(sequences=[[1]], prompt_tokens=1, ttft_s=0.0, step_s=[], decode_tokens=0)]
    m = fast_path.check_match(OneStep(), None, [[[5]]], lambda b: opts, flipped)
    assert m == {"compiled_match": 0.0, "compiled_tie_flips": 1.0, "compiled_max_gap_ulps": 1.0}
    assert opts.choose is None  # the replay hook is removed again
    with pytest.raises(QuantbenchError, match="compile_match=strict"):
        fast_path.check_match(OneStep(), None, [[[5]]], lambda b: opts, flipped, policy="strict")
    far = [Generation(sequences=[[2]], prompt_tokens=1, ttft_s=0.0, step_s=[], decode_tokens=0)]  # 128 ulps down
    with pytest.raises(QuantbenchError, match="128.0 ulps below"):
        fast_path.check_match(OneStep(), None, [[[5]]], lambda b: opts, far)


def test_ulp_follows_dtype_and_magnitude():
    assert fast_path.ulp(27.0, torch.bfloat16) == 0.125
    assert fast_path.ulp(4.0, torch.bfloat16) == 0.03125
    assert fast_path.ulp(1.0, torch.float32) == 2.0**-23


@pytest.mark.slow  # one tiny compile (~20-40 s of CPU on 2 cores; cached by inductor afterwards)
def test_compiled_run_matches_eager_and_keeps_compile_time_out_of_the_timing(compose, results_overrides, tmp_path):
    # the default prompts with lengths of their own (a JSONL workload), the longest FAST's 8: the same compiled
    # shapes as a plain run (inductor's cache serves the test below), and the check must compare each prompt at
    # its own length, strictly
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": n}) + "\n"
                             for p, n in zip(PROMPT_SETS["default"], LIMITS, strict=True)))
    own = [f"measure.prompts={jsonl}", *NO_ACC, *results_overrides]
    compiled = runner.run(compose([*FAST, *COMPILED, "measure.compile_match=strict", *own]))
    assert compiled.status == "OK", compiled.error
    eager = runner.run(compose([*FAST, "measure.cache=static", *own]))
    m = compiled.metrics
    assert m["compiled_match"] == 1.0 and m["generated_tokens"] == 2 * sum(LIMITS)  # 2 repetitions
    assert compiled.tags["fast_path"] == "compiled" and eager.tags["fast_path"] == "eager"
    assert compiled.tags["measure.compile"] == "true" and compiled.tags["measure.cache"] == "static"
    assert [s["tokens"] for s in compiled.samples] == [s["tokens"] for s in eager.samples]
    assert "compile_s" not in eager.metrics
    # compiling (tracing + inductor, even from its disk cache) takes a second or more; a tiny decode step
    # takes milliseconds: had compilation leaked into a timed step, that step would last >= compile_s
    assert m["compile_s"] > 0.1
    assert m["itl_ms_p99"] < 1000 * m["compile_s"] / 10
    assert m["generated_tokens"] / m["decode_tokens_per_s"] < m["compile_s"]


@pytest.mark.slow  # shares the tiny compile with the test above through inductor's cache
def test_recompilation_inside_the_timed_region_fails():
    from harness.models import TinyRandom, load_pretrained

    model = load_pretrained(TinyRandom(), "float32", "cpu")
    opts = DecodeOptions(max_new_tokens=4, pad_token_id=0, cache="static")
    warmed = [[[5, 6, 7]]]  # batch size 1 only
    fast = fast_path.FastPath(model, device="cpu", max_cache_len=fast_path.max_cache_len(warmed + [[[1] * 5]], 4))
    fast_path.compile_warmup(Greedy(), model, warmed, opts, fast)
    assert fast.compiled_graphs >= 1 and fast.compile_s > 0
    with fast.timing():  # a shape the warmup covered: no compile, no error
        Greedy().generate(model, [[8, 9, 10, 11, 12]], opts)
    with pytest.raises(QuantbenchError, match="recompile"), fast.timing():
        greedy_batch2 = [[5, 6, 7], [8, 9]]  # batch size 2: a decode shape the warmup never ran
        from strategies.decode import greedy_generate

        greedy_generate(model, greedy_batch2, opts)


def test_auto_quantizer_answers_for_the_backend_it_resolved_to():
    from quantizers.auto import Auto

    q = Auto(bits="int8")
    q._resolved = NotCompilable(dtype="float32")  # what preflight(device) would have picked
    assert "cannot be compiled" in fast_path.compile_blocker(q, "cpu")
    q._resolved = Dtype(dtype="float32")
    assert fast_path.compile_blocker(q, "cpu") == ""


def test_fixed_shape_step_uncompiled_reproduces_the_plain_loop():
    """The compiled_match reference (fixed-length cache reused across calls, padded mask, no compile)
    decodes what the plain loop decodes, batch 1 and a left-padded batch 2 (fp32: no rounding ties)."""
    from harness.models import TinyRandom, load_pretrained

    model = load_pretrained(TinyRandom(), "float32", "cpu")
    opts = DecodeOptions(max_new_tokens=6, pad_token_id=0, cache="static")
    batches = [[[5, 6, 7]], [[8, 9, 10, 11, 12]], [[5, 6, 7], [8, 9]]]
    plain = [Greedy().generate(model, b, opts) for b in batches]
    fast = fast_path.FastPath(model, device="cpu", max_cache_len=fast_path.max_cache_len(batches, 6) + 7)
    opts.fast_path = fast
    assert fast_path.check_match(Greedy(), model, batches, lambda b: opts, plain)["compiled_match"] == 1.0
    assert fast.eager is False and opts.fast_path is fast and fast.compiled_graphs == 0  # nothing compiled
    assert set(fast._caches) == {1, 2}  # one reused cache per batch size


def test_packed_gqa_attention_computes_what_sdpa_computes():
    """The fast path's attention (decode-step query groups packed, no KV copy) equals transformers' SDPA."""
    from transformers import StaticCache

    from harness.models import TinyRandom, load_pretrained

    model = load_pretrained(TinyRandom(), "float32", "cpu")  # 4 query heads, 2 KV heads

    def prefill_and_step():
        cache = StaticCache(config=model.config, max_cache_len=16)
        first = model(input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                      cache=cache, use_cache=True).logits
        mask = torch.zeros(1, 16, dtype=torch.long)
        mask[:, :5] = 1
        step = model(input_ids=torch.tensor([[9]]), attention_mask=mask, position_ids=torch.tensor([[4]]),
                     cache=cache, use_cache=True).logits
        return first, step

    with torch.inference_mode():
        before = prefill_and_step()
        assert fast_path.use_packed_gqa(model)
        assert model.config._attn_implementation == fast_path.PACKED_SDPA
        after = prefill_and_step()
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_graph_breaks_are_counted_per_run_with_the_commonest_reason():
    def step(x):
        y = x.sin()
        print("a graph break")  # noqa: T201 - dynamo cannot trace print: one break per trace
        return y.cos()

    before = compile_diag.graph_breaks()
    torch.compile(step, backend="eager")(torch.randn(3))
    tags = compile_diag.graph_break_tags(before, compile_diag.graph_breaks())
    assert tags["compile.graph_breaks"] == "1" and tags["compile.graph_break"].startswith("1x ")
    assert "\n" not in tags["compile.graph_break"]
    assert compile_diag.graph_break_tags({"a": 2}, {"a": 2, "b": 1}) == {"compile.graph_breaks": "1",
                                                                       "compile.graph_break": "1x b"}
    assert compile_diag.graph_break_tags({"a": 2}, {"a": 2}) == {"compile.graph_breaks": "0"}


def test_a_compile_that_fails_at_run_time_falls_back_to_eager_only_where_asked(compose, monkeypatch):
    # auto on CUDA switches measure.compile_fallback on: a format whose step cannot be captured decodes eager,
    # tagged, instead of failing; without the switch the same failure fails the run
    def broken(*args, **kwargs):
        raise RuntimeError("CUDA graph capture failed:\n  operation not permitted when stream is capturing")

    monkeypatch.setattr(fast_path, "prepare", broken)
    ok = runner.run(compose([*FAST, *COMPILED, *NO_ACC, "measure.compile_fallback=true"]))
    assert ok.status == "OK", ok.tags.get("error")
    assert ok.tags["fast_path"] == "eager-fallback" and ok.metrics["decode_tokens_per_s"] > 0
    assert ok.tags["fast_path.error"] == "CUDA graph capture failed: operation not permitted when stream is capturing"
    failed = runner.run(compose([*FAST, *COMPILED, *NO_ACC]))
    assert failed.status == "FAILED" and "capture failed" in failed.tags.get("error", "")


def test_graphs_kept_out_of_cuda_graphs_are_counted_with_the_reason():
    import logging

    def step(x):
        return (x.sin() + 1).cos()

    with compile_diag.CudagraphSkips() as skips:  # on CPU inductor counts every reduce-overhead graph as skipped
        torch.compile(step, mode="reduce-overhead")(torch.randn(8))
        log = logging.getLogger(compile_diag.CUDAGRAPH_LOG)
        # torch's re-recording warning (cudagraph_utils.py) is not a skip: it gets a tag of its own
        log.warning("CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size. ...")
        log.warning("skipping cudagraphs due to cpu device (arg3_1)\n  more")
        log.warning("skipping cudagraph due to function 3 exceeding max re-recording limit (=50)")
    assert skips.count == 1
    assert skips.tags() == {"compile.cudagraph_skips": "1",
                            "compile.cudagraph_skip": "skipping cudagraphs due to cpu device (arg3_1) more",
                            "compile.cudagraph_warning": "CUDAGraph supports dynamic shapes by recording a new graph "
                                                         "for each distinct input size. ..."}
    logging.getLogger(compile_diag.CUDAGRAPH_LOG).warning("after the run")  # the handler is gone
    assert len(skips.reasons) == 2 and len(skips.warnings) == 1
