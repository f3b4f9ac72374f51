"""CPU awareness: ISA detection, the device table per ISA, the fp32 upcast of 16-bit prefill, the
kernel tag from a profiled decode step, and the slow-kernel alarm naming the kernels (tiny model only)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAST

from harness.env import CpuInfo, parse_cpuinfo

ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2 sha_ni vaes vpclmulqdq

processor\t: 1
vendor_id\t: AuthenticAMD
flags\t\t: fpu avx512f avx512_bf16
"""
ZEN5 = ("vendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC 9005\n"
        "flags\t\t: avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 avx512_vp2intersect\n")
SAPPHIRE = ("vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel Xeon Platinum 8480\n"
            "flags\t\t: avx2 fma avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n")
OLD = "vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 45\nmodel name\t: Xeon E5\nflags\t\t: sse4_2 avx\n"


def test_isa_parsed_from_cpuinfo_first_block_only():
    zen3 = parse_cpuinfo(ZEN3, "AVX2")
    assert (zen3.isa, zen3.native_bf16, zen3.uarch, zen3.family, zen3.model) == ("avx2", False, "zen3", "25", "1")
    tags = zen3.tags()
    assert tags["cpu.isa"] == "avx2" and tags["cpu.bf16"] == "emulated" and tags["cpu.flags"] == "avx2,fma"
    assert tags["cpu.family"] == "25" and tags["cpu.model"] == "1" and tags["cpu.torch_capability"] == "AVX2"
    assert "zen3, family 25 model 1" in zen3.describe() and "bf16 emulated" in zen3.describe()
    zen5 = parse_cpuinfo(ZEN5)
    assert (zen5.isa, zen5.native_bf16, zen5.uarch) == ("avx512_bf16", True, "zen5")
    assert "avx512_vnni" in zen5.tags()["cpu.flags"]
    spr = parse_cpuinfo(SAPPHIRE)
    assert (spr.isa, spr.native_bf16, spr.uarch) == ("amx", True, "")
    # Zen 4 by its model number (Genoa 17), also where a VM hides its AVX-512 flags (was named zen3 there)
    genoa = ZEN3.replace("model\t\t: 1\n", "model\t\t: 17\n")
    assert genoa != ZEN3 and parse_cpuinfo(genoa).isa == "avx2" and parse_cpuinfo(genoa).uarch == "zen4"
    assert parse_cpuinfo(genoa.replace("avx2 fma", "avx2 fma avx512f")).uarch == "zen4"
    assert (parse_cpuinfo(OLD).isa, parse_cpuinfo("").isa) == ("baseline", "baseline")


def test_every_run_is_tagged_with_its_cpu():
    from harness.env import cpu_info, machine_tags

    tags = machine_tags("cpu", 2)
    assert tags["cpu.isa"] == cpu_info().isa and tags["cpu.isa"] in ("baseline", "avx2", "avx512", "avx512_bf16", "amx")
    assert tags["cpu.bf16"] in ("native", "emulated") and tags["cpu.family"] == cpu_info().family


@pytest.mark.parametrize("text, model_dtype, want", [
    (ZEN3, "bfloat16", "bfloat16"),  # emulated bf16: kept (decode), multi-token matmuls upcast (prefill)
    (ZEN5, "bfloat16", "bfloat16"),
    (OLD, "bfloat16", "float32"),  # no AVX2: fp32
    (ZEN5, "float32", "float32"),  # none never lowers an explicit float32
    (ZEN3, "float16", "float16"),
])
def test_none_resolves_through_the_isa_table(text, model_dtype, want):
    from quantizers.auto import float_choice

    dtype, why = float_choice("cpu", model_dtype, parse_cpuinfo(text))
    assert dtype == want and parse_cpuinfo(text).isa in why
    assert float_choice("cuda", "bfloat16", parse_cpuinfo(text))[0] == "bfloat16"


@pytest.mark.parametrize("text, model_dtype, native", [(SAPPHIRE, "float16", True), (SAPPHIRE, "bfloat16", True),
                                                       (ZEN5, "float16", False), (ZEN3, "bfloat16", False)])
def test_none_says_native_exactly_where_the_prefill_is_not_upcast(compose, monkeypatch, text, model_dtype, native):
    """float_choice's "native" and apply_prefill_matmul's rule are one (quantizers.auto.native_16bit): fp16 is native
    with AVX512_FP16 (Sapphire Rapids), where the resolution once said emulated and the prefill tag native."""
    from harness import env
    from harness.config import build
    from harness.models import load_tokenizer

    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: parse_cpuinfo(text))
    exp = build(compose(FAST + ["quantizer=none", f"model.dtype={model_dtype}"]))
    exp.quantizer.preflight("cpu")
    exp.quantizer.load(exp.model, tokenizer=load_tokenizer(exp.model), device="cpu", experiment=exp)
    tags = exp.quantizer.last_tags
    assert tags["quantizer.resolved_by"].endswith("(native)") is native, tags
    assert tags["quantizer.prefill_matmul"].startswith("native") is native, tags


def test_int_aliases_pick_rows_by_compile_and_isa(monkeypatch):
    from quantizers import auto

    cpu = parse_cpuinfo(ZEN3)
    assert auto.candidates("int4", "cpu", False, cpu) == ("cpu", auto.TABLE["int4"]["cpu"])
    assert auto.TABLE["int4"]["cpu"][0] == "torchao_int4"
    monkeypatch.setitem(auto.TABLE, "int8", {"cpu": ("quanto_int8",), "cpu+compile": ("torchao_int8",),
                                             "cpu/native_bf16": ("bnb_int8",)})
    assert auto.candidates("int8", "cpu", False, cpu)[1] == ("quanto_int8",)
    assert auto.candidates("int8", "cpu", True, cpu)[1] == ("torchao_int8",)
    assert auto.candidates("int8", "cpu", False, parse_cpuinfo(ZEN5))[1] == ("bnb_int8",)


def test_none_records_its_resolution_and_the_prefill_upcast(compose, monkeypatch):
    from harness import env
    from harness.config import build
    from harness.models import load_tokenizer
    from quantizers.dtype import PREFILL_ROWS

    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: parse_cpuinfo(ZEN3))
    exp = build(compose(FAST + ["quantizer=none", "model.dtype=bfloat16"]))
    exp.quantizer.preflight("cpu")
    model = exp.quantizer.load(exp.model, tokenizer=load_tokenizer(exp.model), device="cpu", experiment=exp)
    tags = exp.quantizer.last_tags
    assert tags["quantizer.resolved"] == "bf16" and "avx2" in tags["quantizer.resolved_by"]
    assert tags["quantizer.prefill_matmul"].startswith(f"fp32 from {PREFILL_ROWS} rows") and PREFILL_ROWS == 12
    lin = model.model.layers[0].mlp.down_proj
    assert type(lin) is torch.nn.Linear and lin.weight.dtype == torch.bfloat16  # class and bytes unchanged
    x = torch.randn(2, PREFILL_ROWS // 2, lin.in_features, dtype=torch.bfloat16)  # 2 sequences x 6 tokens
    want = torch.nn.functional.linear(x.float(), lin.weight.float()).bfloat16()  # fp32 accumulation
    assert torch.equal(lin(x), want)
    for rows in (1, 4, PREFILL_ROWS - 1):  # decode steps, batched decode of 4: native bf16
        few = x.reshape(-1, lin.in_features)[:rows]
        assert torch.equal(lin(few), torch.nn.functional.linear(few, lin.weight))

    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: parse_cpuinfo(ZEN5))
    exp = build(compose(FAST + ["quantizer=bf16"]))
    exp.quantizer.preflight("cpu")
    exp.quantizer.load(exp.model, tokenizer=load_tokenizer(exp.model), device="cpu", experiment=exp)
    assert exp.quantizer.last_tags["quantizer.prefill_matmul"].startswith("native")


@pytest.mark.parametrize("quantizer,kernel", [("torchao_int4", "aten::_weight_int4pack_mm_for_cpu"),
                                              ("torchao_int8", "aten::_weight_int8pack_mm")])  # eager, both
def test_profiled_decode_step_names_the_int_kernel(compose, quantizer, kernel):
    from harness.config import build
    from harness.measure import kernels
    from harness.models import load_tokenizer
    from strategies.base import DecodeOptions
    from strategies.greedy import Greedy

    exp = build(compose(FAST + [f"quantizer={quantizer}"]))
    exp.quantizer.preflight("cpu")
    model = exp.quantizer.load(exp.model, tokenizer=load_tokenizer(exp.model), device="cpu", experiment=exp)
    tags, metrics = kernels.profile_linear(Greedy(), model, [[5, 6, 7, 8]], DecodeOptions(max_new_tokens=8))
    assert tags["kernel.linear"] == kernel, tags
    assert tags["kernel.profiled"] == "4 decode steps" and 0 < metrics["kernel_linear_share"] <= 1
    assert tags["kernel.linear_calls_per_step"] == str(7 * exp.model.num_hidden_layers)  # q k v o gate up down
    # the output projection (tied embedding, never quantized) is tagged apart, one 16-bit matmul per step
    assert tags["kernel.lm_head"] in ("aten::mm", "aten::addmm", "aten::linear"), tags
    assert tags["kernel.lm_head_calls_per_step"] == "1" and 0 < metrics["kernel_lm_head_share"] <= 1


def test_dominant_linear_ignores_attention_and_compiled_regions():
    from harness.measure.kernels import dominant_linear

    events = [("aten::bmm", 900.0, 4), ("Torch-Compiled Region: 0/0", 5000.0, 4), ("aten::mm", 300.0, 844),
              ("aten::_weight_int8pack_mm", 700.0, 840), ("aten::_scaled_dot_product_flash_attention_for_cpu", 800.0, 120)]
    got = dominant_linear(events, 4)
    assert got["kernel.linear"] == "aten::_weight_int8pack_mm" and got["kernel.linear_calls_per_step"] == "210"
    assert dominant_linear([("aten::add", 1.0, 1)], 1) == {"kernel.linear": "none found"}
    # a CUDA graph replay (compile_mode=reduce-overhead on a GPU) runs no ATen op on the host: said so
    assert dominant_linear([("Torch-Compiled Region: 0/0", 50.0, 4), ("aten::add", 1.0, 1)], 4) == {
        "kernel.linear": "not visible (compiled region, e.g. a CUDA graph replay)"}


def test_output_projection_in_rows8_tiles_is_tagged_apart():
    """quantizers/rows8.py's layers take the matrix in tiles ([N/4, K/32, 128], [N/16, ...]): no operand has the
    vocabulary's rows, yet the head is still told apart (the 8B bf16 cell first said 'none found')."""
    from harness.measure.kernels import dominant_linear

    vocab = 128256
    events = [("quantbench::gemv16t", 9000.0, 4, [[1, 1, 2048], [vocab // 4, 64, 128]]),  # the head
              ("quantbench::gemv16t", 40000.0, 448, [[1, 1, 2048], [2048, 64, 128]]),  # the body (8192 rows)
              ("quantbench::gemv8t", 3000.0, 4, [[1, 1, 2048], [vocab // 16, 512, 64], [vocab]]),
              ("quantbench::gemv16t", 500.0, 4, [[1, 1, 2048], [vocab // 4, 64, 64]])]  # not gemv16t's tiles
    got = dominant_linear(events, 4, vocab, held=frozenset({(vocab // 4, 64, 128)}))  # the head's tiled copy
    assert got["kernel.linear"] == "quantbench::gemv16t" and got["kernel.linear_calls_per_step"] == "113"
    assert got["kernel.lm_head"] == "quantbench::gemv16t" and got["kernel.lm_head_calls_per_step"] == "1"


def test_output_projection_is_tagged_apart_from_the_body_kernel():
    """The Zen 5 case: int kernels so fast that the one bf16 output-projection matmul (vocab 49152) takes
    more self time than all the body's int8 matmuls together; `kernel.linear` must still name the body's."""
    from harness.measure.kernels import dominant_linear

    vocab = 49152
    events = [("aten::mm", 900.0, 4, [[1, 576], [576, vocab]]),               # output projection
              ("aten::_weight_int8pack_mm", 500.0, 420, [[1, 576], [576, 576], [576]]),
              ("aten::_weight_int8pack_mm", 300.0, 420, [[1, 576], [1536, 576], [1536]]),
              ("aten::mm", 20.0, 8, [[1, 64], [64, 64]]),                      # a small body mm
              ("aten::embedding", 50.0, 4, [[vocab, 576], [1, 1]])]
    got = dominant_linear(events, 4, vocab)
    assert got["kernel.linear"] == "aten::_weight_int8pack_mm", got   # rows of one op summed over shapes
    assert got["kernel.linear_calls_per_step"] == "210" and got["kernel.linear_share"] == f"{800 / 1770:.0%}"
    assert got["kernel.lm_head"] == "aten::mm" and got["kernel.lm_head_calls_per_step"] == "1"
    assert abs(got["kernel_lm_head_share"] - 900 / 1770) < 1e-9
    # without the vocabulary (or without shapes) every op competes, as before
    assert dominant_linear([e[:3] for e in events], 4)["kernel.linear"] == "aten::mm"


def test_alarm_fires_on_int8_slower_than_bf16_with_the_kernels_named(monkeypatch, tmp_path):
    """The Zen 3 case: torchao int8 eager (a dequantize + aten::mm per call) slower than bf16. It fires
    on whichever run comes second, so the order of two run.py calls cannot hide it."""
    from harness.analysis import roofline

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    bf16 = {"bytes_per_step": 271e6, "decode_tokens_per_s": 31.1, "roofline_fraction": 0.27}
    int8 = {"bytes_per_step": 166e6, "decode_tokens_per_s": 18.8, "roofline_fraction": 0.10}
    group = {"model": "smollm2", "engine": "transformers"}
    first = roofline.check_slow_kernel(group, "int8", int8, "cpu", 2, kernel="aten::mm")
    assert first is None  # nothing to compare with yet
    warning = roofline.check_slow_kernel(group, "bf16", bf16, "cpu", 2, kernel="aten::mm")
    assert warning.startswith(roofline.SLOW_TAG) and "int8 [kernel aten::mm] reads 166 MB/step" in warning
    assert "bf16 [kernel aten::mm]" in warning
    fast8 = {**int8, "decode_tokens_per_s": 33.0, "roofline_fraction": 0.18}  # compiled: _weight_int8pack_mm
    assert roofline.check_slow_kernel(group, "int8", fast8, "cpu", 2, kernel="aten::_weight_int8pack_mm") is None
    rows = [{"group": 1, "label": "bf16", **bf16}, {"group": 1, "label": "int8", "kernel": "aten::mm", **int8}]
    assert roofline.slow_kernel_flags(rows)[1].startswith(f"{roofline.SLOW_TAG} int8 [kernel aten::mm]")


def test_compile_backend_zentorch_refused_where_it_cannot_optimize(compose, monkeypatch):
    from harness import env
    from harness.errors import ConfigError
    from harness.measure import fast_path

    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: parse_cpuinfo(ZEN3))
    assert "pip install zentorch" in fast_path.backend_blocker("zentorch", "cpu")  # not installed here
    # installed (a spec stands in): refused for the ISA on an AVX2 CPU, allowed on AVX-512. Either message used to
    # pass this test, so losing the AVX-512 check went unseen where zentorch is not installed (everywhere here)
    real = fast_path.importlib.util.find_spec
    monkeypatch.setattr(fast_path.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "zentorch" else real(name, *a))
    assert "optimizes only on AVX-512 CPUs and this one is avx2" in fast_path.backend_blocker("zentorch", "cpu")
    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: parse_cpuinfo(ZEN5))
    assert fast_path.backend_blocker("zentorch", "cpu") == ""
    monkeypatch.setattr(env, "cpu_info", lambda *a, **k: parse_cpuinfo(ZEN3))
    assert fast_path.backend_blocker("inductor", "cpu") == ""
    assert "CPU backend" in fast_path.backend_blocker("zentorch", "cuda")
    from harness.config import build

    with pytest.raises(ConfigError, match="measure.compile_backend='tvm' is not allowed; choose one of: inductor, zentorch"):
        build(compose(FAST + ["measure.compile_backend=tvm"]))


def test_cpuinfo_dataclass_defaults_are_baseline():
    assert CpuInfo().isa == "baseline" and not CpuInfo().native_bf16 and CpuInfo().uarch == ""


def test_sweep_report_names_the_cpu_and_warns_when_cpus_differ():
    from harness.records import report

    def cell(isa: str, family: str) -> dict:
        tags = {"quantizer.name": "bf16", "cpu_model": "AMD EPYC", "cpu.isa": isa, "cpu.family": family,
                "cpu.model": "1", "cpu.bf16": "emulated", "threads": "2", "device": "cpu"}
        return {"status": "OK", "tags": tags, "metrics": {"decode_tokens_per_s": 30.0}, "run_name": f"c{isa}"}

    one = report.markdown(report.rows_for([cell("avx2", "25")]), "bf16")
    assert "Measured on AMD EPYC (family 25 model 1, avx2, bf16 emulated), 2 threads." in one
    two = report.markdown(report.rows_for([cell("avx2", "25"), cell("avx512_bf16", "26")]), "bf16")
    assert "Cells ran on 2 different machines" in two and "avx512_bf16" in two


def test_compiled_int4_reaches_the_packed_kernel_with_guards_skipped(compose, results_overrides):
    """The fastest int4 path: torchao's packed CPU int4 under torch.compile, guard checks skipped in the
    timed steps; the tag is profiled from the compiled step, and the eager re-check passes."""
    from harness.run import runner

    r = runner.run(compose(FAST + ["quantizer=int4", "measure.cache=static", "measure.compile=true",
                                   "measure.compile_skip_guards=true", "measure.repetitions=1", "measure.gemv=aten",
                                   "accuracy.enabled=false"] + results_overrides))  # gemv=aten: torchao's kernel
    assert r.status == "OK", r.error
    assert r.tags["fast_path"] == "compiled" and r.tags["quantizer.resolved"] == "torchao_int4"
    assert r.tags["kernel.linear"] == "aten::_weight_int4pack_mm_for_cpu", r.tags
    assert r.tags["cpu.isa"] and r.metrics["compile_s"] > 0 and "compiled_match" in r.metrics
