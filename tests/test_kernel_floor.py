"""Issue #29 on CPU: the GPU kernel tag read from a recorded profile (harness/measure/cuda_kernels.py) and the floor
row (harness/measure/floor.py): its module set, one row per call, the CUDA-graph branch's fallback, the arithmetic
of the step against it. No test needs CUDA: the device rows are recorded kernel names and times, the capture a fake.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness import metrics
from harness.measure import cuda_kernels as ck
from harness.measure import floor, kernels, one_row
from strategies.base import DecodeOptions

# demangled kernel names as CUPTI records them (torch 2.11 on an H200, cuBLAS 13, FlashAttention 2/3, Triton)
GEMV = ("void gemv2T_kernel_val<int, int, __half, __half, float, 128, 16, 4, 4, false, false, cublasGemvParamsEx<int, "
        "__half const*, __half const*, __half*>>(cublasGemvParamsEx<int, __half const*, __half const*, __half*>, "
        "float, float)")
GEMV_K = GEMV.replace("128, 16, 4, 4", "128, 32, 4, 4")  # another tile: a row of its own in the profile
GEMVX = ("std::enable_if<!(T7), void>::type internal::gemvx::kernel<int, int, __half, __half, __half, float, false, "
         "true, true, false, 7, false, cublasGemvParamsEx<int, __half const*, __half const*, __half*>, float>"
         "(cublasGemvParamsEx<int, __half const*, __half const*, __half*>)")
XMMA = ("sm90_xmma_gemm_f16f16_f16f32_f32_nn_n_tilesize64x64x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
        "__5x_cublas")
FLASH = ("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<64, 64, 128, 4, false, false, cutlass::half_t, "
         "Flash_kernel_traits<64, 64, 128, 4, cutlass::half_t>>, false, false, false, false, true, true, false, false>"
         "(Flash_fwd_params)")
FLASH3 = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloop"
          "FwdSm90<2, cute::tuple<cute::C<1>>>>>>(flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<x>>::Params)")
ELEMENTWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::Half>, "
               "std::array<char*, 3ul>>(int, at::native::CUDAFunctor_add<c10::Half>, std::array<char*, 3ul>)")
REDUCE = ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<c10::Half, at::native::MeanOps<float, float, "
          "float, float>, unsigned int, c10::Half, 4, 4>>(at::native::ReduceOp<c10::Half, at::native::MeanOps<float, "
          "float, float, float>, unsigned int, c10::Half, 4, 4>)")
SOFTMAX = "void (anonymous namespace)::softmax_warp_forward<c10::Half, c10::Half, float, 8, false, false>(c10::Half*)"
DEQUANT = "void dequantize_int8_weight_kernel<__half>(signed char const*, __half const*, __half*, int, int)"
MARLIN = "void marlin::Marlin<256, 1, 8, 8, 4, 8>(int4 const*, int4 const*, int4*, int4 const*, int, int, int, int*)"
TINYGEMM = ("void at::native::tinygemm_m16n8k16_chunk_kernel<(at::native::KReductionType)0, at::native::ALayout_RM, "
            "at::native::BLayout_TC_int4<8, 128>, 256, 8>(void const*, void const*, void const*, void*, int, int, int, "
            "int, int, int)")
BNB4 = ("void kgemm_4bit_inference_naive<__half, 128, 16>(int, int, int, __half*, unsigned char*, float*, "
        "float const*, __half*, int, int, int)")
CUTLASS = ("void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_tn_align8>"
           "(cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_tn_align8::Params)")
MEMCPY = "Memcpy DtoD (Device -> Device)"


def test_kernel_names_are_read_from_demangled_signatures():
    assert ck.kernel_name(GEMV) == "gemv2T_kernel_val"
    assert ck.kernel_name(GEMVX) == "internal::gemvx::kernel"  # the return type's template is not the name
    assert ck.kernel_name(XMMA) == XMMA  # a cuBLAS token stays whole
    assert ck.kernel_name("triton_tem_fused_mm_0") == "triton_tem_fused_mm_0"
    assert ck.kernel_name(TINYGEMM) == "at::native::tinygemm_m16n8k16_chunk_kernel"
    assert ck.kernel_name(SOFTMAX) == "softmax_warp_forward"  # (anonymous namespace) dropped
    assert ck.kernel_name(MARLIN) == "marlin::Marlin"
    assert ck.kernel_name(MEMCPY) == MEMCPY
    # a CUTLASS wrapper keeps its first template argument: the only part that says what it computes
    assert ck.kernel_name(CUTLASS) == "cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_relu_f16_64x64_32x6_tn_align8>"
    assert ck.kernel_name(FLASH3) == "cutlass::device_kernel<flash::enable_sm90_or_later>"


@pytest.mark.parametrize("raw,linear", [
    (GEMV, True), (GEMVX, True), (XMMA, True), (MARLIN, True), (TINYGEMM, True), (BNB4, True), (DEQUANT, True),
    (CUTLASS, True), ("void cublasLt::splitKreduce_kernel<32, 16, int, __half, __half, float, __half>(x)", True),
    # cuBLAS's own GEMMs on sm_90+ (CUDA 12.8+): only their split-K variants matched before
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", True), ("nvjet_sm90_tst_64x16_64x16_2x4_h_bz_TNT", True),
    ("triton_tem_fused_mm_0", True), ("triton_red_fused__to_copy_mm_mul_2", True),
    ("triton_red_fused__to_copy_mul_sum_0", True), ("triton_red_fused__softmax_exp_mul_sum_4", False),
    ("triton_poi_fused_dequantize_affine_0", True),
    (FLASH, False), (FLASH3, False), (ELEMENTWISE, False), (REDUCE, False), (SOFTMAX, False), (MEMCPY, False),
    ("Memset (Device)", False), ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", False),
    ("triton_poi_fused_add_cat_index_2", False), ("triton_tem_fused_bmm_3", False),
    ("void flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<64>>(Flash_fwd_params)", False),
])
def test_kernels_are_classified_linear_or_not(raw, linear):
    assert ck.is_linear_kernel(ck.kernel_name(raw)) is linear


def test_cublas_gemv_step_names_gemv_with_its_share_and_calls():
    rows = [(GEMV, 2400.0, 120), (GEMV_K, 600.0, 48), (FLASH, 500.0, 24), (ELEMENTWISE, 300.0, 200),
            (REDUCE, 100.0, 50), (MEMCPY, 100.0, 4), ("aten::mm", 0.0, 168)]  # a host row: no device time of its own
    got = ck.dominant_cuda_kernel(rows, 4)
    assert got["kernel.linear"] == "gemv2T_kernel_val" and got["kernel.device"] == "cuda"
    assert got["kernel.linear_share"] == "75%" and got["kernel_linear_share"] == pytest.approx(3000 / 4000)
    assert got["kernel.linear_calls_per_step"] == "42"  # both tiles summed: 168 calls over 4 steps
    assert got["kernel_linear_ms_per_step"] == pytest.approx(3000 / 1e3 / 4)
    assert "kernel.linear_2nd" not in got and got["kernel.linear_path_share"] == "75%"
    assert got["kernel.lm_head"].startswith("not profiled apart")  # no eager call of the head was profiled
    # a 16-bit model: the head's one gemv a step is summed with the body's under one name, and the tag says so
    shared = ck.dominant_cuda_kernel(rows, 4, ck.head_kernels([(GEMV, 30.0, 1)]))
    assert shared["kernel.linear"] == "gemv2T_kernel_val" and shared["kernel.linear_share"] == "75%"
    assert shared["kernel.lm_head"] == "gemv2T_kernel_val: the body's linears run the same kernel, not told apart"


def test_the_output_projection_is_told_apart_by_the_kernels_of_one_eager_call():
    # 1B int4: Marlin reads ~0.5 GB a step and the 16-bit head's gemv as much; the head must not name the format
    head = ck.head_kernels([(GEMV, 31.0, 1), (ELEMENTWISE, 2.0, 1), ("aten::linear", 0.0, 1)])
    assert head == frozenset({"gemv2T_kernel_val"})  # linear kernels with device time only
    rows = [(MARLIN, 1000.0, 448), (GEMV, 1100.0, 4), (FLASH, 250.0, 64), (ELEMENTWISE, 150.0, 300)]
    got = ck.dominant_cuda_kernel(rows, 4, head)
    assert got["kernel.linear"] == "marlin::Marlin" and got["kernel.linear_calls_per_step"] == "112"
    assert got["kernel.lm_head"] == "gemv2T_kernel_val" and got["kernel.lm_head_calls_per_step"] == "1"
    assert got["kernel.lm_head_share"] == "44%" and got["kernel_lm_head_ms_per_step"] == pytest.approx(1100 / 1e3 / 4)
    assert "kernel.linear_2nd" not in got and got["kernel.linear_path_share"] == "84%"  # head and body
    assert ck.dominant_cuda_kernel(rows, 4)["kernel.linear"] == "gemv2T_kernel_val"  # what it read without
    # the eager call's kernel never ran in the compiled step (inductor lowered the head otherwise): said so
    missing = ck.dominant_cuda_kernel(rows, 4, frozenset({"gemvx_kernel"}))
    assert missing["kernel.lm_head"] == "not seen in the profiled steps (one eager call ran gemvx_kernel)"
    assert missing["kernel.linear"] == "gemv2T_kernel_val"


def test_a_dequantize_then_gemm_path_reports_both_kernels():
    # a weight-only int8 path that unpacks the weight and calls a cuBLAS gemm: the reader needs to see both
    rows = [(DEQUANT, 900.0, 168), (XMMA, 1500.0, 168), (FLASH, 300.0, 24), (ELEMENTWISE, 200.0, 100)]
    got = ck.dominant_cuda_kernel(rows, 4)
    assert got["kernel.linear"] == XMMA and got["kernel.linear_share"] == f"{1500 / 2900:.0%}"
    assert got["kernel.linear_2nd"] == "dequantize_int8_weight_kernel"
    assert got["kernel.linear_2nd_share"] == f"{900 / 2900:.0%}" and got["kernel.linear_2nd_calls_per_step"] == "42"
    assert got["kernel.linear_path_share"] == f"{2400 / 2900:.0%}"


@pytest.mark.parametrize("rows,name,share,second", [
    # GPTQ through Marlin, the 16-bit output projection through cuBLAS's gemv: 2nd at >= 10%
    ([(MARLIN, 1200.0, 120), (GEMV, 400.0, 4), (FLASH, 250.0, 24), (ELEMENTWISE, 150.0, 80)],
     "marlin::Marlin", "60%", "gemv2T_kernel_val"),
    # torchao int4 (tinygemm, _weight_int4pack_mm): the head's gemv under 10% is not reported
    ([(TINYGEMM, 1400.0, 120), (GEMV, 150.0, 4), (FLASH3, 250.0, 24), (ELEMENTWISE, 200.0, 80)],
     "at::native::tinygemm_m16n8k16_chunk_kernel", "70%", None),
    # bitsandbytes nf4 at one row
    ([(BNB4, 3000.0, 120), (GEMVX, 100.0, 4), (SOFTMAX, 300.0, 24), (ELEMENTWISE, 600.0, 400)],
     "kgemm_4bit_inference_naive", "75%", None),
    # inductor's kernels: a Triton mm template and a one-row mm as a reduction; rsqrt (a norm) and bmm are not linear
    ([("triton_tem_fused_mm_0", 1000.0, 100), ("triton_red_fused__to_copy_mm_mul_2", 400.0, 20),
      ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", 300.0, 40), ("triton_tem_fused_bmm_3", 300.0, 20)],
     "triton_tem_fused_mm_0", "50%", "triton_red_fused__to_copy_mm_mul_2"),
])
def test_quantized_and_compiled_paths_name_their_kernel(rows, name, share, second):
    got = ck.dominant_cuda_kernel(rows, 4)
    assert (got["kernel.linear"], got["kernel.linear_share"], got.get("kernel.linear_2nd")) == (name, share, second)


def test_no_kernels_or_no_linear_kernel_is_said_so():
    assert ck.dominant_cuda_kernel([], 4)["kernel.linear"] == "no CUDA kernels recorded"
    assert ck.dominant_cuda_kernel([("aten::mm", 0.0, 4)], 4)["kernel.linear"] == "no CUDA kernels recorded"
    got = ck.dominant_cuda_kernel([(FLASH, 10.0, 1), (ELEMENTWISE, 30.0, 1)], 1)
    assert got["kernel.linear"] == "none found among 2 kernels (top: at::native::vectorized_elementwise_kernel)"
    assert "kernel_linear_share" not in got


def test_device_rows_keep_the_cuda_rows_of_key_averages():
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    averages = [SimpleNamespace(key="aten::mm", device_type=cpu, self_device_time_total=2400, count=168),
                SimpleNamespace(key=GEMV, device_type=cuda, self_device_time_total=2400, count=168),
                SimpleNamespace(key=MEMCPY, device_type=cuda, self_device_time_total=10, count=1)]
    assert ck.device_rows(averages) == [(GEMV, 2400.0, 168), (MEMCPY, 10.0, 1)]  # the host op's time is the kernel's


def test_every_metric_of_the_kernel_tag_and_the_floor_is_defined():
    found = ck.dominant_cuda_kernel([(DEQUANT, 900.0, 168), (XMMA, 1500.0, 168)], 4)
    names = [k for k in found if not k.startswith("kernel.")]
    names += [*floor.summary([0.001], 3, "one CUDA graph")[0], *floor.floor_report(10.0, 6.0)[0]]
    assert names and metrics.undefined(names) == []


# ------------------------------------------------------------------------------------------ the floor row
class PackedLinear(torch.nn.Module):
    """Shaped like gptqmodel's QuantLinear: in/out features and packed buffers, not an nn.Linear."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.in_features, self.out_features = k, n
        self.register_buffer("qweight", torch.zeros(k // 8, n, dtype=torch.int32))
        self.register_buffer("scales", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros(*x.shape[:-1], self.out_features) + self.scales


class Adapter(torch.nn.Module):
    """A weight of its own around an inner nn.Linear (a LoRA-like wrapper): the model calls the outer one."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.in_features, self.out_features = k, n
        self.base = torch.nn.Linear(k, n)
        self.extra = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.extra


def toy() -> torch.nn.Module:
    holder = torch.nn.Module()  # a wrapper with no weight of its own: its inner linear is counted
    holder.proj = torch.nn.Linear(16, 8)
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16), holder, torch.nn.LayerNorm(8),
                               PackedLinear(8, 32), Adapter(32, 8)).eval()


def test_floor_modules_are_every_linear_once_quantized_and_wrapped_ones_included():
    model = toy()
    got = [m for m, _ in floor.linear_modules(model)]
    assert got == [model[1], model[2].proj, model[4], model[5]]  # not Adapter.base: inside a counted module
    assert [k for _, k in floor.linear_modules(model)] == [8, 16, 8, 32]


def test_floor_on_cpu_calls_each_linear_once_per_pass_on_one_row():
    model, seen = toy(), []
    for mod, _ in floor.linear_modules(model):
        mod.register_forward_pre_hook(lambda m, args: seen.append((m, tuple(args[0].shape))))
    got, tags = floor.linear_floor(model, torch.float32, "cpu", repeats=3)
    assert len(seen) == 4 * (1 + 3)  # one eager warm-up pass, three timed: every linear once in each
    assert {shape for _, shape in seen} == {(1, 1, 8), (1, 1, 16), (1, 1, 32)}
    assert seen[:4] == [(m, (1, 1, k)) for m, k in floor.linear_modules(model)]
    assert got["linear_floor_ms"] > 0 and got["linear_floor_spread_ms"] >= 0
    assert tags == {"kernel.floor": "eager pass on cpu: 4 linears, one row each, median of 3 passes"}


def test_floor_failures_and_empty_models_are_tagged_not_raised():
    broken = torch.nn.Sequential(PackedLinear(8, 4))
    broken[0].forward = lambda x: (_ for _ in ()).throw(RuntimeError("kernel not built\nmore"))
    assert floor.linear_floor(broken, torch.float32, "cpu") == ({}, {"kernel.floor": "failed: kernel not built"})
    assert floor.linear_floor(torch.nn.Sequential(torch.nn.ReLU()), torch.float32, "cpu") == \
        ({}, {"kernel.floor": "no linear modules found"})


def test_cuda_branch_replays_the_graph_or_falls_back_to_eager_and_says_why():
    def one_pass():
        return "eager"

    def replay():
        return "graph"

    run, how = floor.runner(one_pass, "cuda", capture=lambda fn: replay, cleanup=lambda: None)
    assert (run(), how) == ("graph", "one CUDA graph")

    cleaned = []

    def refuse(fn):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")

    run, how = floor.runner(one_pass, "cuda:0", capture=refuse, cleanup=lambda: cleaned.append(1))
    assert run() == "eager" and cleaned == [1]
    assert how == "eager on cuda (capture failed: CUDA error: operation not permitted when stream is capturing)"
    assert floor.runner(one_pass, "cpu", capture=refuse)[1] == "eager pass on cpu"  # capture never tried off CUDA
    # the tag says replays for the graph, passes for the fallback
    assert floor.summary([0.002, 0.001, 0.004], 225, "one CUDA graph") == (
        {"linear_floor_ms": pytest.approx(2.0), "linear_floor_spread_ms": pytest.approx(3.0)},
        {"kernel.floor": "one CUDA graph: 225 linears, one row each, median of 3 replays"})
    assert floor.summary([0.001], 2, how)[1]["kernel.floor"].endswith("median of 1 passes")
    assert floor.summary([], 2, how) == ({}, {})


def test_time_passes_syncs_around_every_pass():
    calls = []
    times = floor.time_passes(lambda: calls.append("run"), 3, lambda: calls.append("sync"))
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert calls == ["sync", "run", "sync"] * 3


def test_floor_report_arithmetic():
    got, tags = floor.floor_report(10.0, 6.0)
    assert got == {"linear_floor_share": pytest.approx(0.6), "step_rest_ms": pytest.approx(4.0)} and tags == {}
    got, tags = floor.floor_report(5.0, 6.0)  # a floor above the step is kept and flagged, not hidden
    assert got["linear_floor_share"] == pytest.approx(1.2) and got["step_rest_ms"] == pytest.approx(-1.0)
    assert tags["warning.floor"].startswith("linear floor 6.000 ms > decode step 5.000 ms")
    for step, fl in ((None, 6.0), (10.0, None), (float("nan"), 6.0), (10.0, 0.0), (0.0, 1.0)):
        assert floor.floor_report(step, fl) == ({}, {})


def test_the_decode_step_is_batch_over_tokens_per_second():
    assert floor.decode_step_ms({"decode_tokens_per_s": 50.0}) == pytest.approx(20.0)
    assert floor.decode_step_ms({"decode_tokens_per_s": 200.0, "batch_size": 4.0}) == pytest.approx(20.0)
    for bad in ({}, {"decode_tokens_per_s": float("nan")}, {"decode_tokens_per_s": 0.0}):
        assert floor.decode_step_ms(bad) is None


def test_a_speculative_step_is_a_verify_steps_tokens_and_is_not_set_against_the_floor():
    """A speculative step (draft + verify) emits tokens_per_verify_step tokens: its length is those over tokens/s, as
    the roofline counts it. Was batch / tokens/s, 5x too short here: a 15 ms floor read 'above the 10 ms step' (a
    false warning.floor) of a 50 ms step. Nor is the floor (the target's linears once, one row) a fair measure of that
    step's linear work (k draft forwards, a k+1-row verify): no share, no rest, a tag that says why."""
    m = {"decode_tokens_per_s": 100.0, "batch_size": 1.0, "tokens_per_verify_step": 5.0, "num_draft_tokens": 4.0}
    assert floor.decode_step_ms(m) == pytest.approx(50.0)
    for per_step in (5.0, float("nan")):  # NaN: no verify step ran; still not compared
        got, tags = floor.step_report({**m, "tokens_per_verify_step": per_step, "linear_floor_ms": 15.0})
        assert got == {} and list(tags) == ["kernel.floor_share"], tags
        assert tags["kernel.floor_share"].startswith("not compared: a speculative step (up to 4 draft tokens and one "
                                                     "verify of up to 5 of the target")
    assert floor.step_report(m) == ({}, {})  # no floor measured: nothing to say
    greedy = {"decode_tokens_per_s": 100.0, "batch_size": 1.0, "linear_floor_ms": 15.0}  # one target forward: compared
    assert floor.step_report(greedy)[1]["warning.floor"].startswith("linear floor 15.000")


def test_stream_rate_takes_the_floor_pass_wall_on_cpu_instead_of_timing_again():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)).eval()
    assert one_row.stream_rate(model, torch.float32, "cpu", False, wall_ms=12.5)["kernel_stream_wall_ms"] == 12.5


class Steps:
    """A stepwise strategy's decode loop, reduced to what the profile's hook needs: one forward and `choose` per step."""

    stepwise = True

    def generate(self, model, batch, opts):
        x = torch.randn(len(batch), 1, model[0].in_features)
        for i in range(opts.max_new_tokens):
            opts.choose(model(x), i)


def test_the_cpu_profile_is_unchanged_by_the_cuda_branch():
    # matrices big enough that addmm's own time (the product) outweighs aten::linear's (a wrapper around it): with
    # 8 x 64 layers the two were within noise, and the test once read aten::linear
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 1024),
                                torch.nn.Linear(1024, 256)).eval()
    assert kernels.model_device(model) == "cpu" and kernels.model_device(torch.nn.ReLU()) == "cpu"
    with torch.inference_mode():
        tags, got = kernels.profile_linear(Steps(), model, [[5, 6, 7, 8]], DecodeOptions(max_new_tokens=8))
    assert tags["kernel.linear"] == "aten::addmm" and "kernel.device" not in tags, tags
    assert tags["kernel.profiled"] == "4 decode steps" and tags["kernel.linear_calls_per_step"] == "3"
    assert 0 < got["kernel_linear_share"] <= 1


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_cuda_model_is_profiled_with_device_activity_and_tagged_from_its_kernels(monkeypatch):
    # a CPU build records no CUDA rows: the wiring is what is checked (activities, sync, the device tags)
    synced = []
    monkeypatch.setattr(kernels, "model_device", lambda model: "cuda")
    monkeypatch.setattr(kernels, "sync", synced.append)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    with torch.inference_mode():
        tags, got = kernels.profile_linear(Steps(), model, [[5]], DecodeOptions(max_new_tokens=8))
    assert synced == ["cuda"]  # the prefill's kernels end before the profiled steps
    assert tags["kernel.device"] == "cuda" and tags["kernel.linear"] == "no CUDA kernels recorded", tags
    assert tags["kernel.profiled"] == "4 decode steps" and got == {}


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_a_cuda_profile_tells_the_head_apart_by_its_eager_calls_kernels(monkeypatch):
    # the wiring on CPU: the head's eager call is profiled on the step's batch rows, its kernels split the step's
    asked = []
    monkeypatch.setattr(kernels, "model_device", lambda model: "cuda")
    monkeypatch.setattr(kernels, "sync", lambda device: None)
    monkeypatch.setattr(kernels, "profile_head_kernels", lambda model, rows: asked.append(rows) or
                        ck.head_kernels([(GEMV, 30.0, 1)]))
    monkeypatch.setattr(ck, "device_rows", lambda averages: [(MARLIN, 1000.0, 448), (GEMV, 1100.0, 4)])
    model = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    with torch.inference_mode():
        tags, got = kernels.profile_linear(Steps(), model, [[5], [6]], DecodeOptions(max_new_tokens=8))
    assert asked == [2] and tags["kernel.linear"] == "marlin::Marlin" and tags["kernel.lm_head"] == "gemv2T_kernel_val"
    assert got["kernel_lm_head_share"] == pytest.approx(1100 / 2100)
    # a head off CUDA is never profiled (its eager call has no CUDA kernels to name)
    monkeypatch.undo()
    cpu_head = SimpleNamespace(get_output_embeddings=lambda: torch.nn.Linear(8, 32))
    assert kernels.profile_head_kernels(cpu_head, 1) == frozenset()


def test_the_compiled_floor_pass_runs_under_the_steps_inductor_flags(monkeypatch):
    # torchao int8 reaches its fused kernel only when compiled with coordinate-descent tuning on: the floor of a
    # compiled quantized step must be compiled with the same flags, or it times the dequantize-then-mm path
    import torch._inductor.config as inductor_config

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, mode: (lambda: seen.append(
        (mode, inductor_config.coordinate_descent_tuning)) or fn()))
    calls = []
    run = floor.compiled_pass(lambda: calls.append(1), {"coordinate_descent_tuning": True})
    before = inductor_config.coordinate_descent_tuning
    run()
    assert seen == [("default", True)] and calls == [1]  # mode default: the CUDA graph is the floor's own
    assert inductor_config.coordinate_descent_tuning == before  # patched for the call only


@pytest.mark.parametrize("quantizer, device, fast, compiled", [
    ("torchao_int8", "cuda", True, True),  # eager Int8Tensor dequantizes: the floor compiles like the step
    ("torchao_int4", "cuda", True, False),  # tinygemm is one op eager and compiled: no second compile
    ("torchao_int8", "cuda", False, False),  # an eager step gets an eager floor
    ("torchao_int8", "cpu", True, False),
])
def test_the_floor_compiles_only_where_the_eager_call_dequantizes(monkeypatch, quantizer, device, fast, compiled):
    from harness.config import build, compose
    from harness.run import engines

    exp = build(compose(["model=tiny_random", f"quantizer={quantizer}", "accuracy.enabled=false"]))
    session = engines.TransformersSession(exp, device, 1)
    session.model = SimpleNamespace(dtype=torch.bfloat16)
    session.fast = SimpleNamespace(inductor={"coordinate_descent_tuning": True}) if fast else None
    seen = {}
    monkeypatch.setattr(engines.kernels, "profile_linear", lambda *a, **k: ({}, {}))
    monkeypatch.setattr(engines.one_row, "stream_rate", lambda *a, **k: {})
    monkeypatch.setattr(engines.floor, "linear_floor", lambda *a, inductor=None, **k: seen.update(i=inductor) or ({}, {}))
    session.kernel_profile([[1]], SimpleNamespace(gemv_aten=False), Path("/dev/null"))
    assert (seen["i"] is not None) == compiled


def test_the_compiled_floor_pass_keeps_every_matmul():
    """Real torch.compile on CPU: a pass whose outputs are dropped is dead code to inductor, which removes every
    matmul (the compiled floor then timed an empty graph); the pass returns them, so each is computed."""
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    mods = [(torch.nn.Linear(16, 8), 16), (torch.nn.Linear(8, 4), 8)]
    one_pass = floor.pass_of(mods, {k: torch.randn(1, 1, k) for k in (8, 16)})
    with torch.no_grad():
        eager = one_pass()
        got, code = run_and_get_code(floor.compiled_pass(one_pass, {}))
    assert len(got) == 2 and all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, eager, strict=True))
    assert code and any("mm" in c or "gemm" in c or "addmm" in c for c in code), code


def test_peak_memory_is_read_before_the_side_measurements_and_a_failed_stream_rate_is_a_tag(monkeypatch, tmp_path):
    """The floor row's graph pool and an eager dequantizing profile step must not count as the run's peak memory;
    the stream rate, like the floor, is a side measurement: its failure is a tag, the run stays OK."""
    from harness.config import build, compose
    from harness.run import engines, pipeline, runner

    peak = [123.0]

    def floor_allocates(*a, **k):
        peak[0] = 99_999.0  # what the profile and floor passes would add
        return {}, {}

    monkeypatch.setattr(pipeline.measure, "peak_memory_mb", lambda device: peak[0])
    monkeypatch.setattr(engines.floor, "linear_floor", floor_allocates)
    monkeypatch.setattr(engines.one_row, "stream_rate", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no\nmore")))
    result = runner.execute(build(compose(["model=tiny_random", "quantizer=bf16", "measure.max_new_tokens=4",
                                           "measure.repetitions=1", "measure.warmup=0", "accuracy.enabled=false",
                                           "tracking.enabled=false", f"tracking.results_dir={tmp_path}"])))
    assert result.status == "OK", result.error
    assert result.metrics["peak_mem_mb"] == 123.0 and peak[0] == 99_999.0  # the floor ran, after the reading
    assert result.tags["kernel.stream"] == "failed: no" and "kernel_stream_gb" not in result.metrics


def test_cupti_starts_before_any_cuda_graph_capture(monkeypatch):
    """A reduce-overhead fast path on CUDA starts the profiler's CUDA side first (the kernel profile replays graphs
    captured earlier); on CPU it does not; a missing or failing hook is False, never an error."""
    import torch.profiler._utils as prof_utils

    from harness.measure import cuda_kernels, fast_path

    calls = []
    monkeypatch.setattr(cuda_kernels, "init_profiler_for_cuda_graphs", lambda: calls.append(1) or True)
    monkeypatch.setattr(fast_path, "use_packed_gqa", lambda model: False)
    fast_path.FastPath(torch.nn.Linear(2, 2), device="cuda", max_cache_len=8, mode="reduce-overhead")
    fast_path.FastPath(torch.nn.Linear(2, 2), device="cpu", max_cache_len=8, mode="default")
    assert calls == [1]
    monkeypatch.undo()
    monkeypatch.setattr(prof_utils, "_init_for_cuda_graphs", lambda: (_ for _ in ()).throw(RuntimeError("no CUPTI")))
    assert cuda_kernels.init_profiler_for_cuda_graphs() is False
    monkeypatch.delattr(prof_utils, "_init_for_cuda_graphs")
    assert cuda_kernels.init_profiler_for_cuda_graphs() is False
