"""The decode path (measure.path), the one-row kernel (measure.gemv), auto16 and the kernel streaming rate.

Resolution is checked without loading a model (the Llama-3.2-1B preset is counted from its config): which
row of the measured table a CPU, format and size read; the fallbacks when freezing does not fit or a
compile would not finish in the sweep's timeout; one-line refusals of an explicit path that cannot run.
The gemv switch is checked where it acts: oneDNN is off inside batch-1 decode steps only.
"""

from __future__ import annotations

import pytest
import torch

from harness import env
from harness.config import build, compose
from harness.env import CpuInfo
from harness.errors import ConfigError, QuantbenchError
from harness.measure import memory, one_row, paths
from harness.run import llama_cpp, runner
from strategies.base import DecodeOptions
from strategies.decode import greedy_generate

ZEN4 = CpuInfo(vendor="AuthenticAMD", family="25", model="17", model_name="AMD EPYC 9004",
               flags=frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"}))
ZEN3 = CpuInfo(vendor="AuthenticAMD", family="25", model="1", model_name="AMD EPYC 7003",
               flags=frozenset({"avx2", "fma"}))
ONE_B = ["model=random", "model.arch=llama-3.2-1b", "measure.prompts=synthetic:1", "measure.prompt_tokens=8",
         "measure.max_new_tokens=4", "measure.device=cpu"]


def _exp(*overrides: str):
    exp = build(compose([*ONE_B, *overrides]))
    exp.quantizer.preflight("cpu")  # int8/int4: the device table's backend (what the engine does first)
    return exp


@pytest.fixture()
def zen4(monkeypatch):
    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: ZEN4)
    monkeypatch.setattr(memory, "available_bytes", lambda device: (64e9, "test"))


def test_best_reads_the_measured_row_for_this_cpu_format_and_size(zen4, monkeypatch):
    exp = _exp("quantizer=bf16")
    choice = paths.settle(exp, "cpu")
    assert (choice.path, choice.gemv) == ("compiled", "rows8")  # quantbench's 8-row kernel (quantizers/rows8.py)
    assert exp.measure.compile and exp.measure.cache == "static" and not exp.measure.compile_freezing
    assert choice.by.startswith("zen4 16 >= 1B params") and "cpu_kernels.py" in choice.by
    assert paths.settle(exp, "cpu") is choice  # idempotent: run.py and the runner both call it
    assert paths.settle(_exp("quantizer=int4"), "cpu").path == "compiled"
    tiny = build(compose(["model=tiny_random", "quantizer=bf16"]))  # below 1B: no row, eager
    assert paths.settle(tiny, "cpu").path == "eager" and not tiny.measure.compile
    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: ZEN3)  # the ISA line's row, and no oneDNN bf16 to avoid
    z3 = paths.settle(_exp("quantizer=int4"), "cpu")
    assert z3.path == "freezing" and z3.by.startswith("avx2 int4") and z3.gemv == "aten" and "not native" in z3.gemv_by
    assert paths.settle(_exp("quantizer=bf16", "measure.gemv=onednn"), "cpu").gemv == "onednn"


def test_best_falls_back_when_freezing_does_not_fit_or_a_compile_would_time_out(zen4, monkeypatch):
    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: ZEN3)  # Zen 3's int4 row is freezing
    monkeypatch.setattr(memory, "runtime_bytes", lambda device: 4.0e9)  # a big process: it is not counted twice
    est = memory.transformers_estimate(_exp("quantizer=int4"), "cpu")
    roomy = est.total - est.parts["runtime"] + est.parts["weights"] * 1.5
    monkeypatch.setattr(memory, "available_bytes", lambda device: (roomy, "test"))
    assert paths.settle(_exp("quantizer=int4"), "cpu").path == "freezing"  # MemAvailable already excludes the process
    exp = _exp("quantizer=int4")
    est = memory.transformers_estimate(exp, "cpu")
    # room for the run, not for freezing's second copy of the weights (what is available excludes the process)
    free = est.total - est.parts["runtime"] + est.parts["weights"] * 0.5
    monkeypatch.setattr(memory, "available_bytes", lambda device: (free, "test"))
    choice = paths.settle(exp, "cpu")
    assert choice.path == "compiled" and choice.by.startswith("freezing refused (freezing holds a prepacked copy")
    assert exp.measure.compile and not exp.measure.compile_freezing
    slow = _exp("quantizer=bf16")
    slow.config["sweep"] = {"timeout_s": 40}  # 1B (16 layers): the compile estimate is 52 s, over half of 40
    choice = paths.settle(slow, "cpu")
    assert choice.path == "eager" and "compiled refused (compiling takes up to ~52 s" in choice.by
    assert not slow.measure.compile


def test_freezing_is_counted_in_the_memory_estimate(zen4):
    exp = _exp("quantizer=int4", "measure.path=freezing")
    paths.settle(exp, "cpu")
    est = memory.transformers_estimate(exp, "cpu")
    assert est.parts["freezing copy"] == est.parts["weights"] > 0


def test_an_explicit_path_that_cannot_run_is_refused_in_one_line(zen4, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: (3.0e9, "test"))
    with pytest.raises(QuantbenchError) as err:
        paths.settle(_exp("quantizer=bf16", "measure.path=freezing"), "cpu")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("measure.path=freezing cannot run: freezing holds a prepacked copy")
    assert "measure.path=best" in msg
    with pytest.raises(QuantbenchError, match="strategy Speculative-model4 runs its own loop"):
        paths.settle(build(compose(["model=tiny_random", "strategy=speculative", "measure.path=compiled"])), "cpu")
    with pytest.raises(ConfigError) as bad:
        build(compose(["model=tiny_random", "measure.path=fast", "measure.gemv=mkl"]))
    assert "measure.path='fast' is not allowed" in str(bad.value) and "freezing" in str(bad.value)
    assert "measure.gemv='mkl'" in str(bad.value)  # both problems in one error


def test_gemv_aten_switches_onednn_off_inside_batch_1_decode_steps_only(tiny_llama):
    seen: list[tuple[int, bool]] = []
    hook = tiny_llama.register_forward_pre_hook(
        lambda mod, args, kwargs: seen.append((kwargs["input_ids"].shape[1], torch.backends.mkldnn.enabled)),
        with_kwargs=True)
    try:
        greedy_generate(tiny_llama, [[5, 6, 7, 8]], DecodeOptions(max_new_tokens=4, gemv_aten=True))
        assert seen[0] == (4, True) and seen[1:] == [(1, False)] * 3  # prefill keeps oneDNN; decode steps do not
        assert torch.backends.mkldnn.enabled  # restored
        seen.clear()
        greedy_generate(tiny_llama, [[5, 6, 7, 8], [9, 10, 11, 12]], DecodeOptions(max_new_tokens=3, gemv_aten=True))
        assert all(on for _, on in seen)  # batch 2: more than one row per matmul, oneDNN stays
        seen.clear()
        greedy_generate(tiny_llama, [[5, 6, 7, 8]], DecodeOptions(max_new_tokens=3))
        assert all(on for _, on in seen)
    finally:
        hook.remove()


@pytest.fixture()
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_auto16_measures_its_rates_at_the_runs_thread_count(zen4, monkeypatch, tmp_path):
    """Preflight runs before the run sets its threads: the rates were measured (and keyed, and recorded) at torch's
    default, 2 threads here, for a measure.threads=1 run; torch's own count is left as it was."""
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    seen: list[int] = []
    monkeypatch.setattr(one_row, "rates", lambda *a, **k: seen.append(torch.get_num_threads()) or
                        {"bfloat16": 30.0, "float16": 34.0})
    before = torch.get_num_threads()
    q = build(compose(["model=tiny_random", "quantizer=auto16", "measure.threads=1"])).quantizer
    q.preflight("cpu")
    assert seen == [1] and "1 threads" in q._why and torch.get_num_threads() == before
    assert [p.name for p in (tmp_path / "auto16").iterdir()][0].count("-1t-") == 1


def test_stream_rate_reads_every_weight_matrix_once_head_included(tiny_llama):
    got = one_row.stream_rate(tiny_llama, torch.float32, "cpu", gemv_aten=True, repeats=1)
    # 2 layers x (q 32x32, k 32x16, v 32x16, o 32x32, gate/up/down 3 x 32x64) + the tied 64x32 head, fp32
    expect = (2 * (32 * 32 * 2 + 32 * 16 * 2 + 3 * 32 * 64) + 64 * 32) * 4
    assert got["kernel_stream_gb"] * 1e9 == pytest.approx(expect)
    assert got["kernel_stream_ms"] > 0 and got["kernel_stream_wall_ms"] > 0  # the kernels' own time; the pass's wall
    assert got["kernel_stream_gbps"] == pytest.approx(expect / 1e9 / (got["kernel_stream_ms"] / 1e3))


def test_auto16_picks_what_streams_faster_records_why_and_llama_cpp_follows(zen4, monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(one_row, "rates", lambda *a, **k: {"bfloat16": 30.0, "float16": 34.0})
    assert one_row.sixteen_choice("cpu", "aten")[0] == "float16"  # 34 >= 1.10 x 30
    assert llama_cpp.sixteen_format("cpu") == "F16"
    monkeypatch.setattr(one_row, "rates", lambda *a, **k: pytest.fail("measured twice"))  # cached per host
    dtype, why = one_row.sixteen_choice("cpu", "aten")
    assert dtype == "float16" and "bf16 30.0 GB/s, fp16 34.0 GB/s" in why
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(one_row, "rates", lambda *a, **k: {"bfloat16": 30.0, "float16": 32.0})
    assert one_row.sixteen_choice("cpu", "aten")[0] == "bfloat16" and llama_cpp.sixteen_format("cpu") == "BF16"
    q = build(compose(["model=tiny_random", "quantizer=auto16"])).quantizer
    q.preflight("cpu")
    assert q.name == "auto16" and q.dtype == "bfloat16"


def test_a_run_records_its_path_its_kernel_and_the_kernels_streaming_rate(results_overrides):
    result = runner.execute(build(compose(["model=tiny_random", "quantizer=bf16", "measure.max_new_tokens=4",
                                           "measure.repetitions=1", "measure.warmup=0", "accuracy.enabled=false",
                                           *results_overrides])))
    t, m = result.tags, result.metrics
    assert t["measure.path"] == "best" and t["decode_path"] == "eager" and t["decode_path.by"].startswith("no measured")
    assert t["kernel.gemv"] == one_row.gemv_choice("auto", "cpu", env.cpu_info())[0] and t["kernel.gemv_by"]
    assert m["kernel_stream_gb"] > 0 and m["kernel_stream_gbps"] > 0


def test_auto_on_cuda_is_static_cache_and_cuda_graphs_and_says_so(zen4):
    # issue #29 item 4: eager decode on a GPU measures Python launch, so auto there compiles with CUDA graphs
    exp = _exp("quantizer=fp16", "measure.device=cuda")
    choice = paths.settle(exp, "cuda")
    m = exp.measure
    assert (m.compile, m.cache, m.compile_mode, choice.path) == (True, "static", "reduce-overhead", "compiled")
    assert choice.tags()["measure.auto"] == "cuda: static cache + torch.compile reduce-overhead (CUDA graphs)"
    assert m.compile_fallback  # a capture that fails at run time decodes eager (tag fast_path), not FAILED


def test_auto_on_cpu_keeps_todays_defaults(zen4):
    tiny = build(compose(["model=tiny_random", "quantizer=bf16"]))
    choice = paths.settle(tiny, "cpu")
    m = tiny.measure
    assert (m.compile, m.cache, m.compile_mode, choice.path) == (False, "dynamic", "default", "eager")
    assert choice.tags()["measure.auto"].startswith("cpu: eager unless measure.path=best")
    assert paths.settle(_exp("quantizer=bf16"), "cpu").path == "compiled"  # the measured row still decides


@pytest.mark.parametrize("overrides, path, compile_, cache", [
    (["measure.compile=false"], "eager", False, "dynamic"),
    (["measure.cache=dynamic"], "eager", False, "dynamic"),
    (["measure.path=eager"], "eager", False, "dynamic"),
    (["measure.compile_mode=default"], "compiled", True, "static"),
])
def test_an_explicit_value_is_honoured_on_cuda(zen4, overrides, path, compile_, cache):
    exp = _exp("quantizer=fp16", "measure.device=cuda", *overrides)
    choice = paths.settle(exp, "cuda")
    assert (choice.path, exp.measure.compile, exp.measure.cache) == (path, compile_, cache)
    if "measure.compile_mode=default" in overrides:
        assert exp.measure.compile_mode == "default"


def test_auto_on_cuda_falls_back_to_eager_with_the_reason(zen4, caplog):
    exp = _exp("quantizer=fp16", "measure.device=cuda", "measure.context_depth=16")
    choice = paths.settle(exp, "cuda")
    assert choice.path == "eager" and exp.measure.compile is False and exp.measure.cache == "dynamic"
    assert choice.tags()["measure.auto"] == "cuda: eager (measure.context_depth needs the eager step)"
    assert "decoding eager" in caplog.text
    spec = build(compose(["model=tiny_random", "quantizer=fp16", "measure.device=cuda", "strategy=speculative"]))
    assert "runs its own loop" in paths.settle(spec, "cuda").tags()["measure.auto"]


def test_quantizer_none_that_resolves_to_fp32_reads_no_16_bit_row(zen4):
    """quantizer=none keeps its name when it resolves to float32 (model.dtype=float32): it is judged by the dtype it
    loads, so it reads fp32's column (no measured row: eager), not the 16-bit one."""
    exp = _exp("quantizer=none", "model.dtype=float32")
    choice = paths.settle(exp, "cpu")
    assert choice.path == "eager" and choice.by.startswith("no measured row for zen4 other"), choice.by
    assert paths.format_class(exp.quantizer, "float32", "cpu") == "other"
    assert paths.settle(_exp("quantizer=none"), "cpu").by.startswith("zen4 16 >= 1B params")  # bf16: the 16-bit row


# ------------------------------------------------------------------------- explicit settings and what ran
def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        build(compose([*ONE_B, *overrides]))
    msg = str(err.value)
    assert "\n" not in msg and "config problems" not in msg, msg  # one problem, one line
    return msg


def test_a_context_depth_decodes_eager_under_best_and_an_explicit_compiled_path_is_refused(zen4):
    """The compiled path sizes its static cache from the prompts: at a depth it crashed after load + compile."""
    for overrides in (["quantizer=bf16", "measure.context_depth=512"],
                      ["quantizer=int4", "strategy=static_batch", "measure.context_depth=2048"]):
        exp = _exp(*overrides)
        choice = paths.settle(exp, "cpu")
        assert choice.path == "eager" and exp.measure.compile is False and exp.measure.cache == "dynamic"
        assert choice.by.startswith("compiled refused (measure.context_depth needs the eager step)"), choice.by
    for path in ("compiled", "freezing"):
        msg = _refused("quantizer=bf16", f"measure.path={path}", "measure.context_depth=16")
        assert msg.startswith(f"measure.context_depth with measure.path={path} is not supported")


@pytest.mark.parametrize("overrides, by", [
    (["measure.compile=false"], "measure.compile=false"),
    (["measure.compile=false", "measure.cache=dynamic"], "measure.compile=false"),
    (["measure.cache=dynamic"], "measure.cache=dynamic"),
    (["measure.cache=static", "measure.compile=false"], "measure.compile=false"),  # eager over a static cache
])
def test_an_explicit_eager_setting_is_honoured_on_cpu(zen4, overrides, by):
    exp = _exp("quantizer=bf16", *overrides)  # the 1B row says compiled
    choice = paths.settle(exp, "cpu")
    m = exp.measure
    assert (choice.path, m.compile, m.compile_skip_guards) == ("eager", False, False) and choice.by.startswith(by)
    assert m.cache == ("static" if "measure.cache=static" in overrides else "dynamic")
    assert "compile=true" not in choice.tags()["measure.auto"]


@pytest.mark.parametrize("overrides, says", [
    (["measure.path=eager", "measure.compile=true"], "measure.path=eager and measure.compile=true contradict"),
    (["measure.path=compiled", "measure.compile=false"], "measure.path=compiled compiles the decode step"),
    (["measure.path=freezing", "measure.cache=dynamic"], "use measure.path=eager, or drop measure.cache"),
    (["measure.path=compiled", "measure.compile_freezing=true"], "asks for it: use measure.path=freezing"),
    (["measure.compile_freezing=true"], "measure.path=best picks its own path (it may leave freezing off)"),
    (["measure.path=eager", "measure.compile_backend=zentorch", "measure.compile_mode=max-autotune"],
     "measure.compile_mode=max-autotune, measure.compile_backend=zentorch: only a compiled decode step reads it, "
     "and measure.path=eager decodes eager"),
    (["measure.compile=false", "measure.compile_skip_guards=true"], "and measure.compile=false decodes eager"),
    (["strategy=continuous_batch", "measure.cache=static"], "strategy ContinuousBatch schedules its own rows"),
])
def test_contradictory_or_unread_decode_settings_are_refused_in_one_line(overrides, says):
    assert says in _refused("quantizer=bf16", *overrides)


def test_explicit_compile_switches_are_kept_and_unread_ones_tagged_where_best_decides_eager(zen4, caplog):
    exp = _exp("quantizer=bf16", "measure.path=compiled", "measure.compile_skip_guards=false")
    assert paths.settle(exp, "cpu").path == "compiled" and exp.measure.compile_skip_guards is False
    exp = _exp("quantizer=bf16", "measure.path=freezing", "measure.compile_freezing=true")
    assert paths.settle(exp, "cpu").path == "freezing" and exp.measure.compile_skip_guards is True  # auto: on
    tiny = build(compose(["model=tiny_random", "measure.compile_mode=max-autotune"]))  # below 1B: no row, eager
    choice = paths.settle(tiny, "cpu")
    assert choice.path == "eager" and choice.tags()["measure.unused"] == ("measure.compile_mode=max-autotune (the "
                                                                         "decode step runs eager)")
    assert "not used" in caplog.text
    assert "measure.unused" not in paths.settle(_exp("quantizer=bf16", "measure.compile_mode=max-autotune"),
                                                "cpu").tags()  # compiled: read


def test_a_load_run_decodes_as_its_target_whatever_the_row_says(zen4):
    """The in-process load target runs eager continuous batching: no compiled path is chosen, counted or tagged."""
    exp = _exp("quantizer=bf16", "load.profile=sweep")  # the 1B row says compiled
    choice = paths.settle(exp, "cpu")
    assert choice.path == "eager" and choice.by.startswith("load.profile=sweep") and exp.measure.compile is False


# ------------------------------------------------------- explicit settings this CPU runs slower than its default
ZEN5 = CpuInfo(vendor="AuthenticAMD", family="26", model="2", model_name="AMD EPYC 9005", flags=ZEN4.flags)
SAPPHIRE = CpuInfo(vendor="GenuineIntel", family="6", model="143", model_name="Intel Xeon Platinum 8480",
                   flags=frozenset({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16", "amx_bf16",
                                    "amx_tile"}))


@pytest.mark.parametrize("cpu, overrides, says", [
    # bf16 emulated (no avx512_bf16/amx_bf16): the 3x prefill of quantizers/dtype.py
    (ZEN3, ["quantizer=bf16", "quantizer.prefill_matmul=native"], "730 vs 230 ms"),
    (ZEN3, ["quantizer=none", "quantizer.prefill_matmul=native"], "730 vs 230 ms"),  # none resolves to bf16
    # fp16 emulated (no avx512_fp16/amx_fp16), bf16 native or not
    (ZEN4, ["quantizer=fp16", "quantizer.prefill_matmul=native"], "~10x slower than bf16"),
    (ZEN3, ["quantizer=fp16", "quantizer.prefill_matmul=native"], "~10x slower than bf16"),
    # the fp32 upcast where bf16 is native: slower prefill, and the upcast layers miss rows8's tiles in decode
    (ZEN4, ["quantizer=bf16", "quantizer.prefill_matmul=fp32"], "TTFT 66-74 vs 125-260 ms"),
    (ZEN5, ["quantizer=none", "quantizer.prefill_matmul=fp32"], "decode 34-39 vs 47-56 tok/s"),  # none: bf16 here
    # rows8 is the one-row default on Zen 4 / Zen 5 (harness/measure/one_row.py GEMV)
    (ZEN4, ["quantizer=bf16", "measure.gemv=aten"], "rows8 46.8 GB/s vs ATen 39.1 (oneDNN bf16 19)"),
    (ZEN4, ["quantizer=fp16", "measure.gemv=onednn"], "rows8 46.8 GB/s vs ATen 39.1 (oneDNN bf16 19)"),
    (ZEN5, ["quantizer=none", "measure.gemv=onednn"], "Zen 4's row (same ISA line, not re-measured on Zen 5)"),
    # rows8 also re-lays torchao's int layers (VNNI) and the bf16 head: the cost measured side by side
    (ZEN4, ["quantizer=int4", "measure.gemv=aten"], "60.4 tok/s with rows8 vs 38.1 with ATen's GEMV"),
    (ZEN4, ["quantizer=int8", "measure.gemv=onednn"], "49.8 tok/s with rows8 vs 40.2 with ATen's GEMV"),
])
def test_an_explicit_setting_slower_on_this_cpu_is_one_finding(cpu, overrides, says):
    (line,) = paths.forced_slow(_exp(*overrides), "cpu", cpu)
    setting = next(o for o in overrides if not o.startswith("quantizer="))
    assert line.startswith(f"{setting}: ") and says in line, line
    assert cpu.isa in line and "docs/" in line and "Drop " in line and ";" not in line and "\n" not in line


@pytest.mark.parametrize("cpu, overrides", [
    # the default, or auto: by definition the fast one
    (ZEN3, ["quantizer=bf16"]), (ZEN4, ["quantizer=bf16", "measure.gemv=auto", "quantizer.prefill_matmul=auto"]),
    (ZEN4, ["quantizer=bf16", "measure.gemv=rows8"]), (ZEN3, ["quantizer=bf16", "quantizer.prefill_matmul=fp32"]),
    # the same override where this CPU does not run it slower
    (ZEN4, ["quantizer=bf16", "quantizer.prefill_matmul=native"]),  # bf16 native
    (SAPPHIRE, ["quantizer=fp16", "quantizer.prefill_matmul=native"]),  # AVX512_FP16
    (SAPPHIRE, ["quantizer=fp16", "quantizer.prefill_matmul=fp32"]),  # native fp16: no measured cost of the upcast
    (ZEN4, ["quantizer=fp16", "quantizer.prefill_matmul=fp32"]),  # fp16 emulated here: fp32 is what auto picks
    (ZEN4, ["quantizer=fp32", "quantizer.prefill_matmul=fp32"]),  # nothing to upcast
    (ZEN3, ["quantizer=fp32", "quantizer.prefill_matmul=native"]),  # no 16-bit matmul to emulate
    (ZEN3, ["quantizer=bf16", "measure.gemv=aten"]), (ZEN3, ["quantizer=bf16", "measure.gemv=onednn"]),  # auto: aten
    (SAPPHIRE, ["quantizer=bf16", "measure.gemv=onednn"]),  # no measured row: onednn is its default
    (ZEN4, ["quantizer=fp32", "measure.gemv=aten"]),  # rows8 takes 16-bit weights: fp32 has no measured cost
    (ZEN4, ["quantizer=quanto_int8", "measure.gemv=aten"]),  # layers rows8 does not re-lay: no measured cost
    (ZEN4, ["quantizer=torchao_int4", "quantizer.kernel=intx", "measure.gemv=aten"]),  # nor these layouts
    (ZEN4, ["quantizer=torchao_int8", "quantizer.kernel=torchao", "measure.gemv=aten"]),
    (ZEN4, ["quantizer=torchao_int8", "quantizer.dynamic=true", "measure.gemv=aten"]),  # nor int8 x int8
    (ZEN4, ["quantizer=int8", "quantizer.head=int8", "measure.gemv=aten"]),  # measured with the head in 16 bits only
    (ZEN3, ["quantizer=int4", "measure.gemv=aten"]),  # no AVX-512: aten is the default there
])
def test_a_default_or_a_setting_not_slower_here_is_no_finding(cpu, overrides):
    assert paths.forced_slow(_exp(*overrides), "cpu", cpu) == []
    assert paths.forced_slow(_exp("quantizer=fp16", "quantizer.prefill_matmul=native"), "cuda", ZEN3) == []


def test_settle_warns_and_tags_each_finding_without_refusing_the_run(zen4, caplog):
    exp = _exp("quantizer=fp16", "quantizer.prefill_matmul=native", "measure.gemv=aten")
    tag = paths.settle(exp, "cpu").tags()["warning.forced_slow"]
    assert [part.split(":")[0] for part in tag.split("; ")] == ["quantizer.prefill_matmul=native", "measure.gemv=aten"]
    assert caplog.text.count("forced slower than this CPU's default") == 2
    assert "warning.forced_slow" not in paths.settle(_exp("quantizer=fp16"), "cpu").tags()


def test_a_config_settled_twice_in_one_process_warns_once_and_tags_both(zen4, caplog):
    """run.py's check and the runner each build and settle their own copy of one config: one warning line."""
    overrides = ("quantizer=fp16", "quantizer.prefill_matmul=native")
    first, second = paths.settle(_exp(*overrides), "cpu"), paths.settle(_exp(*overrides), "cpu")
    assert caplog.text.count("forced slower than this CPU's default") == 1
    assert first.tags()["warning.forced_slow"] == second.tags()["warning.forced_slow"] != ""
    paths.settle(_exp(*overrides, "measure.seed=7"), "cpu")  # another config: its own line
    assert caplog.text.count("forced slower than this CPU's default") == 2


def test_a_run_forced_onto_a_slower_path_carries_the_tag(results_overrides, monkeypatch):
    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: ZEN3)  # bf16 emulated: prefill_matmul=native is the slow path
    result = runner.execute(build(compose(["model=tiny_random", "quantizer=bf16", "quantizer.prefill_matmul=native",
                                           "measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=0",
                                           "accuracy.enabled=false", "measure.kernel_profile=false",
                                           *results_overrides])))
    assert result.status == "OK", result.error
    assert result.tags["warning.forced_slow"].startswith("quantizer.prefill_matmul=native: bfloat16 is emulated")
    assert result.tags["quantizer.prefill_matmul"] == "native"  # honoured: the run took the slow path it asked for


def test_cpu_kernels_compares_the_default_row_with_its_resolved_peer_and_calls_a_straddling_ratio_undecided(
        monkeypatch, capsys):
    """benchmarks/cpu_kernels.py: the default row's 'vs llama.cpp' divided by BF16 even when it resolved to fp32, and
    'meets/below 0.75' was decided from single medians (76 tok/s, p10-p90 50-95, over 100 with 60-110: 'meets')."""
    import importlib.util
    import sys

    from conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("cpu_kernels", ROOT / "benchmarks" / "cpu_kernels.py")
    ck = importlib.util.module_from_spec(spec)
    monkeypatch.setattr(sys, "argv", ["cpu_kernels.py"])
    spec.loader.exec_module(ck)
    monkeypatch.setattr(llama_cpp, "available", lambda: True)

    def fake(overrides, common):
        if "engine=llama_cpp" in overrides:
            fmt = overrides[-1].split("=")[1]
            return {"decode_tokens_per_s": {"F32": 40.0, "BF16": 100.0}[fmt], "decode_tokens_per_s_p10": 60.0,
                    "decode_tokens_per_s_p90": 110.0, "ttft_ms": {"F32": 100.0, "BF16": 300.0}[fmt]}
        if not overrides:  # the default run, resolved to fp32
            return {"decode_tokens_per_s": 30.0, "ttft_ms": 190.0, "quantizer.resolved": "fp32",
                    "kernel.linear": "aten::mm"}
        return {"decode_tokens_per_s": 76.0, "decode_tokens_per_s_p10": 50.0, "decode_tokens_per_s_p90": 95.0,
                "kernel.linear": "aten::mm", "kernel_linear_share": 0.8, "ttft_ms": 200.0,
                "roofline_fraction": 0.1, "bytes_per_step": 1e6 if "quantizer=bf16" in overrides else 2e6,
                # the run's own tag, from the host's speed cache: a run of some other process, not in this table
                "warning.slow_kernel": "slow kernel path? vs a cached run"}

    monkeypatch.setattr(ck, "run_cell", fake)
    ck.main(["--formats", "fp32,bf16", "--paths", "eager"])
    out = capsys.readouterr().out
    default = next(line for line in out.splitlines() if line.startswith("| default |"))
    assert "| 0.75 |" in default  # 30 / 40 (llama.cpp F32), not 30 / 100 (BF16)
    bf16 = next(line for line in out.splitlines() if line.startswith("- bf16:"))
    assert "0.76x [0.45-1.58] (undecided because noisy 0.75)" in bf16
    # warnings compare this table's rows: bf16 (1 MB/step) is not faster than fp32 (2 MB/step), the cached one is out
    assert "vs a cached run" not in out
    (warning,) = [line for line in out.splitlines() if line.startswith("- warning:")]
    assert warning.startswith("- warning: bf16 eager: slow kernel path? bf16 eager [kernel aten::mm] reads 1 MB/step")
