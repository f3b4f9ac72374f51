"""The format-path table per GPU architecture (quantizers/gpu_paths.py) and what it is wired into, on a machine
without a GPU: the compute capability and package availability are injected (monkeypatched), no model loads on
CUDA. Checked: every row builds into a valid quantizer whose inductor flags are the row's; the per-arch picks
(sm_80 vs sm_90 differ for int4 only); the fallback when mslk is missing, with its reason; `quantizer=int4` /
`quantizer=int8` on a faked sm_90 resolve to the table's path and tag it; the mslk kernels' refusals; GPTQ's kernel
on CUDA; synthetic calibration of random-weight shapes (deterministic per seed, bounded by the vocabulary, seed in
the cache key, a tiny GPTQ run on CPU) and that accuracy on random weights is still refused; that a quantizer's
inductor flags are in force while fast_path compiles and gone after; the docs table is the module's.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST

from harness.errors import ConfigError, QuantbenchError, Unsupported
from harness.measure import fast_path
from harness.models.random_model import IdTokenizer, RandomModel
from quantizers import gpu_paths
from quantizers.auto import CONF_DIR, build_named
from quantizers.gptq import GPTQModelQuantizer, synthetic_calibration
from quantizers.torchao import TorchAoInt4, TorchAoInt8

ROOT = Path(__file__).resolve().parent.parent
H100, A100 = (9, 0), (8, 0)


def _gpu(monkeypatch, capability, installed=("mslk",)):
    """Fake a CUDA device of `capability` with the extra packages in `installed` (others as they are here)."""
    real = gpu_paths.importable
    monkeypatch.setattr(gpu_paths, "device_capability", lambda device: capability if device.startswith("cuda")
                        else None)
    monkeypatch.setattr(gpu_paths, "importable", lambda p: p in installed or (p not in ("mslk", "gemlite") and real(p)))


@pytest.mark.parametrize("key", sorted(gpu_paths.TABLE), ids=lambda k: f"{k[0]}@{k[1]}")
def test_every_row_builds_a_valid_quantizer_with_the_rows_flags(key):
    for path in gpu_paths.TABLE[key]:
        assert (CONF_DIR / f"{path.quantizer}.yaml").is_file(), path.quantizer
        q = build_named(path.quantizer, path.overrides)
        for k, v in path.overrides.items():
            assert getattr(q, k) == v
        assert q.inductor_config("cuda") == path.inductor, path.label  # what the table says reaches the compile
        assert path.source and path.compile_mode in ("default", "reduce-overhead", "max-autotune")


def test_table_covers_every_format_and_arch_and_never_dead_ends():
    assert set(gpu_paths.TABLE) == {(f, a) for f in gpu_paths.FORMATS for a in gpu_paths.ARCHS}
    for key, rows in gpu_paths.TABLE.items():
        assert rows and not rows[-1].package, f"{key}: the last row must need no extra package"
    with pytest.raises(KeyError, match="formats: fp16"):
        gpu_paths.path_for("int3", H100)


def test_gpu_arch_classes():
    cases = {(8, 0): "sm_80", (8, 6): "sm_86", (8, 7): "sm_86", (8, 9): "sm_89", (9, 0): "sm_90",
             (10, 0): "sm_100", (12, 0): "sm_100", (7, 5): "fallback", (7, 0): "fallback", None: "fallback"}
    for cap, arch in cases.items():
        assert gpu_paths.gpu_arch(cap) == arch, cap


def test_per_arch_picks():
    def pick(fmt, cap):
        return gpu_paths.path_for(fmt, cap, lambda p: True).path.label

    # int4: torchao's own rule packs preshuffled (mslk) on sm >= 90, tinygemm below
    assert pick("int4", H100) == pick("int4", (10, 0)) == "torchao_int4 kernel=preshuffled group_size=128"
    assert pick("int4", A100) == pick("int4", (8, 9)) == "torchao_int4 kernel=tinygemm"
    assert pick("int4", (7, 5)) == "bnb_nf4"  # tinygemm needs sm_80
    # int8: the same fused path everywhere; GPTQ/AWQ through Marlin from sm_80
    assert pick("int8", H100) == pick("int8", A100) == "torchao_int8 kernel=fused"
    assert pick("gptq_int4", A100) == pick("gptq_int4", H100) == "gptq_int4 kernel=gptq_marlin"
    assert pick("awq_int4", H100) == "awq_int4 kernel=awq_marlin"
    assert pick("gptq_int4", (7, 5)) == "gptq_int4 kernel=auto"


def test_missing_package_falls_back_with_its_reason():
    choice = gpu_paths.path_for("int4", H100, lambda p: p != "mslk")
    assert choice.path.label == "torchao_int4 kernel=tinygemm"
    assert choice.tags() == {"gpu.arch": "sm_90", "quantizer.gpu_path": "torchao_int4 kernel=tinygemm",
                             "quantizer.gpu_path_by": "gpu path table int4 @ sm_90 row 2 (sm_90); skipped "
                             "torchao_int4 kernel=preshuffled group_size=128 needs mslk (pip install mslk-cuda==1.1.0)"}
    assert gpu_paths.path_for("int4", H100, lambda p: True).by == "gpu path table int4 @ sm_90 row 1 (sm_90)"


def test_kernel_tag_matching():
    rows = {p.label: p for rows in gpu_paths.TABLE.values() for p in rows}
    assert rows["torchao_int4 kernel=tinygemm"].kernel_matches("at::native::tinygemm_m16n8k16_chunk_kernel")
    fused = rows["torchao_int8 kernel=fused"]
    assert fused.kernel_matches("triton_red_fused__to_copy_mm_mul_0") and not fused.kernel_matches("gemv2T_kernel_val")
    assert rows["gptq_int4 kernel=gptq_marlin"].kernel_matches("Marlin")


def _auto(compose, name, compiled=False):
    from harness.config import build

    extra = ["measure.cache=static", "measure.compile=true"] if compiled else []
    return build(compose(FAST + [f"quantizer={name}", "tracking.enabled=false"] + extra)).quantizer


def test_int4_on_a_faked_h100_takes_the_tables_path_and_tags_it(compose, monkeypatch):
    _gpu(monkeypatch, H100)
    q = _auto(compose, "int4", compiled=True)
    q.preflight("cuda")
    assert type(q.resolved) is TorchAoInt4 and (q.resolved.kernel, q.resolved.group_size) == ("preshuffled", 128)
    assert q.backend == "torchao.int4_preshuffled" and q.resolved.load_dtype("float16") == "bfloat16"
    q.resolved.load = lambda *a, **k: SimpleNamespace()  # no model: only the tags of Auto.load are checked
    q.resolved.last_tags = {}
    q.load(None, tokenizer=None, device="cuda", experiment=None)
    assert q.last_tags["gpu.arch"] == "sm_90"
    assert q.last_tags["quantizer.gpu_path"] == "torchao_int4 kernel=preshuffled group_size=128"
    assert q.last_tags["compile.inductor"] == gpu_paths.inductor_tag(gpu_paths.TORCHAO_INDUCTOR)


def test_int4_without_mslk_and_on_an_a100_takes_tinygemm(compose, monkeypatch):
    for cap, installed in ((H100, ()), (A100, ("mslk",))):
        _gpu(monkeypatch, cap, installed)
        q = _auto(compose, "int4")
        q.preflight("cuda")
        assert (q.resolved.kernel, q.resolved.group_size) == ("tinygemm", 64), cap
        q.resolved.load = lambda *a, **k: SimpleNamespace()
        q.resolved.last_tags = {}
        q.load(None, tokenizer=None, device="cuda", experiment=None)
        assert "compile.inductor" not in q.last_tags  # an eager run: no compile, no flags to record
    assert "skipped" not in q.last_tags["quantizer.gpu_path_by"]


def test_int8_on_a_faked_gpu_is_the_fused_path(compose, monkeypatch):
    _gpu(monkeypatch, H100)
    q = _auto(compose, "int8")
    q.preflight("cuda")
    assert type(q.resolved) is TorchAoInt8 and q.resolved.kernel == "fused"
    assert q.backend == "torchao.int8_weight_only+fused"
    assert q.inductor_config("cuda") == gpu_paths.TORCHAO_INDUCTOR


def test_torchao_cuda_kernels_keep_their_flags_out_of_the_process():
    """The CUDA kernels quantize with set_inductor_config=False (flags through inductor_config, per compile);
    kernel=torchao keeps torchao's own behaviour (the path issue #29 measured)."""
    fused, own = TorchAoInt8(), TorchAoInt8(kernel="torchao")
    assert fused.from_pretrained_kwargs("cuda")["quantization_config"].quant_type.set_inductor_config is False
    assert own.from_pretrained_kwargs("cuda")["quantization_config"].quant_type.set_inductor_config is True
    assert own.inductor_config("cuda") == {} and fused.inductor_config("cpu") == {}  # cpu: int8pack
    cfg = TorchAoInt4(kernel="preshuffled", group_size=128).from_pretrained_kwargs("cuda")["quantization_config"]
    assert (cfg.quant_type.int4_packing_format, cfg.quant_type.set_inductor_config) == ("preshuffled", False)


def test_mslk_kernels_refuse_in_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="group_size=64 is not allowed with quantizer.kernel=preshuffled.*128, 256"):
        TorchAoInt4(kernel="preshuffled", group_size=64)
    q = TorchAoInt4(kernel="preshuffled", group_size=128)
    with pytest.raises(Unsupported, match="needs CUDA: .*kernel=preshuffled"):
        q.preflight("cpu")
    _gpu(monkeypatch, H100, installed=())
    with pytest.raises(QuantbenchError, match=r"needs the mslk package.*pip install mslk-cuda==1.1.0"):
        q.preflight("cuda")
    _gpu(monkeypatch, (8, 6))
    with pytest.raises(Unsupported, match="needs sm_90\\+.*this GPU is sm_86; use quantizer.kernel=tinygemm"):
        q.preflight("cuda")
    TorchAoInt4(kernel="plain", group_size=128).preflight("cuda")  # plain: any GPU mslk runs on
    with pytest.raises(Unsupported, match="needs CUDA: quantizer torchao_int8 kernel=fused"):
        TorchAoInt8(kernel="fused").preflight("cpu")


def test_gptq_kernel_auto_on_cuda_follows_the_table(monkeypatch):
    for method, cap, kernel in (("gptq", H100, "gptq_marlin"), ("gptq", A100, "gptq_marlin"), ("rtn", H100,
                                "gptq_marlin"), ("awq", H100, "awq_marlin"), ("gptq", (7, 5), "auto")):
        _gpu(monkeypatch, cap)
        q = GPTQModelQuantizer(method=method)
        q.preflight("cuda")
        assert q._kernel("cuda") == kernel, (method, cap)
    assert GPTQModelQuantizer()._kernel("cpu") == "gptq_torch_int8"


def test_synthetic_calibration_is_seeded_and_bounded():
    a, b = synthetic_calibration(512, 4, 32, 0), synthetic_calibration(512, 4, 32, 1)
    assert a == synthetic_calibration(512, 4, 32, 0) and a != b
    assert len(a) == 4 and all(len(s["input_ids"]) == 32 and s["attention_mask"] == [1] * 32 for s in a)
    ids = [i for s in synthetic_calibration(7, 50, 40, 3) for i in s["input_ids"]]
    assert min(ids) >= 0 and max(ids) < 7 and len(set(ids)) == 7  # uniform over the whole vocabulary


def test_random_shape_calibration_digest_names_the_seed_and_splits_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    source, tok = RandomModel(arch="tiny"), IdTokenizer(512, 1, 2, None)
    dirs = []
    for seed in (0, 0, 5):
        q = GPTQModelQuantizer(calibration_samples=2, calibration_length=8, calibration_seed=seed)
        samples, digest, overlap = q.calibration(tok)
        assert digest.startswith(f"synthetic-seed{seed}-") and not overlap and len(samples) == 2
        dirs.append(q.cache_dir(source, digest))
    assert dirs[0] == dirs[1] != dirs[2]
    with pytest.raises(ConfigError, match="calibration_seed=-1"):
        GPTQModelQuantizer(calibration_seed=-1)


def test_accuracy_on_random_weights_is_still_refused(compose):
    from harness.config import build

    with pytest.raises(QuantbenchError, match="random weights: perplexity and KL on them mean nothing"):
        build(compose(["model=random", "model.arch=tiny", "quantizer=gptq_int4", "accuracy.enabled=true",
                       "tracking.enabled=false"]))


@pytest.mark.slow
def test_gptq_quantizes_a_random_shape_on_synthetic_ids(tmp_path, monkeypatch):
    """gptqmodel loads the random weights through id_model_dir (its loader wants a tokenizer file). ~6 s here.
    Its offload of finished modules goes beside the cache build and is removed with it: never gptqmodel's own
    /tmp folder, which only an interpreter-exit finalizer removed (a sweep cell leaves through os._exit)."""
    import gptqmodel.quantization.config as gconfig

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    monkeypatch.setattr(gconfig, "_create_temp_offload_dir",
                        lambda: pytest.fail("gptqmodel made its own offload folder in /tmp"))
    source = RandomModel(arch="tiny")
    q = GPTQModelQuantizer(group_size=32, calibration_samples=2, calibration_length=32, calibration_seed=3)
    q.preflight("cpu")
    model = q.load(source, tokenizer=source.tokenizer(), device="cpu", experiment=None)
    assert q.last_tags["quantizer.calibration"] == ("synthetic token ids (seed 3, 2 x 32; random-weight shape: "
                                                    "speed only)")
    assert q.last_metrics["calibration_tokens"] == 64.0 and q.last_tags["quantizer.cache"] == "miss"
    with torch.no_grad():
        assert model(input_ids=torch.tensor([[1, 5, 7]])).logits.shape == (1, 3, 512)
    assert os.environ["GPTQMODEL_CPU_WORKERS"] == str(q.workers)
    assert not list(tmp_path.rglob("*.offload*"))  # the offload folder went with the build


def test_quantizer_flags_are_in_force_while_fast_path_compiles(monkeypatch):
    import torch._inductor.config as inductor

    seen = {}

    class FakeFastPath:
        def __init__(self, model, **kwargs):
            seen["init"] = inductor.coordinate_descent_tuning

    def warmup(strategy, model, batches, opts, fast):  # dynamo compiles here, in the first compiled calls
        seen["warmup"] = (inductor.coordinate_descent_tuning, inductor.force_fuse_int_mm_with_mul)

    monkeypatch.setattr(fast_path, "FastPath", FakeFastPath)
    monkeypatch.setattr(fast_path, "compile_warmup", warmup)
    before = inductor.coordinate_descent_tuning
    assert fast_path.quantizer_inductor(TorchAoInt8(), "cuda") == gpu_paths.TORCHAO_INDUCTOR
    assert fast_path.quantizer_inductor(TorchAoInt8(), "cpu") == {} == fast_path.quantizer_inductor(object(), "cuda")
    measure = SimpleNamespace(compile_mode="reduce-overhead", compile_freezing=False, compile_backend="inductor",
                              compile_cpp_wrapper=False, compile_skip_guards=False)
    exp = SimpleNamespace(measure=measure, quantizer=TorchAoInt8(), strategy=None)
    fast = fast_path.prepare(exp, None, SimpleNamespace(device="cuda", max_new_tokens=4), [[[1, 2]]], "compiled")
    assert seen == {"init": True, "warmup": (True, True)} and fast.inductor == gpu_paths.TORCHAO_INDUCTOR
    assert inductor.coordinate_descent_tuning == before  # restored: the next run of a sweep compiles without them


def test_docs_table_is_the_modules():
    doc = (ROOT / "docs" / "quantizers.md").read_text(encoding="utf-8")
    begin, end = "<!-- gpu_paths.markdown() -->\n", "<!-- end gpu_paths.markdown() -->"
    assert begin in doc and end in doc, "docs/quantizers.md lost its GPU paths table markers"
    assert doc.split(begin, 1)[1].split(end, 1)[0].strip() == gpu_paths.markdown().strip(), (
        "docs/quantizers.md's GPU paths table differs from quantizers/gpu_paths.py; paste gpu_paths.markdown()")


def test_the_probe_runs_its_variants_and_writes_a_row_each(tmp_path):
    # benchmarks/gpu_paths_probe.py on CPU (--smoke: tiny shape, eager): the code path the GPU session runs, short of
    # compile and CUDA graphs; the int8 variant that dequantizes per call must read slower per byte than fp16
    import importlib.util
    import json

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("gpu_paths_probe", ROOT / "benchmarks" / "gpu_paths_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    assert probe.main(["--smoke", "--out", str(tmp_path), "--iters", "10"]) == 0
    rows = {r["variant"]: r for r in json.loads((tmp_path / "probe.json").read_text())["rows"]}
    assert set(rows) == {"fp16", "int8_eager"} and all(r["status"] == "OK" for r in rows.values())
    dims = probe.shape("tiny")  # the decode step's 3-D [1, 1, K], as the model feeds its linears (not a 2-D row)
    assert all(r["input"] == [[1, 1, dims["q"][1]], [1, 1, dims["down"][1]]] for r in rows.values())
    assert all(r["us"] > 0 and r["spread_us"] >= 0 and r["kernels"] for r in rows.values())
    assert rows["int8_eager"]["GB/s"] < rows["fp16"]["GB/s"]
    assert "| int8_eager | OK |" in (tmp_path / "probe.md").read_text()


def test_the_documented_probe_call_names_variants_that_exist_and_reaches_the_five_it_reads():
    """docs/gpu.md's device call runs the probe with `--only`: each name a variant (else the probe refuses them all
    at once), the five that tell the causes apart, mslk's last."""
    import importlib.util
    import re

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("gpu_paths_probe", ROOT / "benchmarks" / "gpu_paths_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    calls = re.findall(r"python3 benchmarks/gpu_paths_probe\.py .*--only (\S+)", (ROOT / "docs" / "gpu.md").read_text())
    assert len(calls) == 1
    names = calls[0].split(",")
    assert set(names) <= set(probe.VARIANTS)
    assert names == ["fp16", "int8_fused", "int8_gptfast", "int4_tinygemm_g64", "int4_preshuffled_g128"]


@pytest.mark.parametrize("bits", ["int8", "int4"])
def test_head_int8_is_refused_on_cuda_in_one_line(monkeypatch, bits):
    """head=int8 is a CPU path: quantizer=int8/int4 builds its backend with it (so the backend's own checks run,
    not a head set after them), and torchao's quantizers refuse it on CUDA before anything loads."""
    from harness.config import build, compose

    _gpu(monkeypatch, H100)
    q = build(compose(["model=tiny_random", f"quantizer={bits}", "quantizer.head=int8"])).quantizer
    with pytest.raises(QuantbenchError, match=r"quantizer.head=int8 is a CPU path") as err:
        q.preflight("cuda")
    assert "\n" not in str(err.value)
    for cls in (TorchAoInt8, TorchAoInt4):  # kernel=auto is a CPU kernel too: only the device tells
        with pytest.raises(QuantbenchError, match=r"^quantizer.head=int8 is a CPU path .*; on cuda use "
                                                  r"quantizer.head=keep$"):
            cls(head="int8").preflight("cuda")


SMOL_WIDTHS = ["model.hidden_size=576", "model.intermediate_size=1536", "model.num_attention_heads=9",
               "model.num_key_value_heads=3"]  # SmolLM2-135M's widths, one layer


def test_int4_falls_through_to_the_next_row_where_the_picks_group_size_cannot_take_the_model(compose, monkeypatch):
    """The sm_90 pick forces group_size=128, which does not divide SmolLM2's 576: torchao would leave every layer
    unquantized and the audit refuse after the whole load. The candidate's preflight refuses instead, from the
    config, and the table's next row (tinygemm, groups of 64) runs; gpu_path_by says why."""
    from harness.config import build

    _gpu(monkeypatch, H100)
    q = build(compose(FAST + ["quantizer=int4", "tracking.enabled=false", "model.num_hidden_layers=1"]
                      + SMOL_WIDTHS)).quantizer
    q.preflight("cuda")
    assert (q.resolved.kernel, q.resolved.group_size) == ("tinygemm", 64)
    q.resolved.load = lambda *a, **k: SimpleNamespace()
    q.resolved.last_tags = {}
    q.load(None, tokenizer=None, device="cuda", experiment=None)
    assert q.last_tags["quantizer.gpu_path"] == "torchao_int4 kernel=tinygemm"
    assert q.last_tags["quantizer.gpu_path_by"].startswith("gpu path table int4 @ sm_90 row 2 (sm_90); torchao_int4 "
                                                          "kernel=preshuffled group_size=128 did not run (torchao_int4:"
                                                          " quantizer torchao_int4 group_size=128 does not divide the "
                                                          "input width 576")
    assert "use quantizer.kernel=tinygemm" in q.last_tags["quantizer.gpu_path_by"]  # no mslk group size takes 576


def test_tinygemm_bound_follows_the_padded_shapes(compose, monkeypatch):
    """tinygemm pads in_features to a multiple of 1024 (out to 8): SmolLM2's 576-wide layers store 7.5 bits/weight
    at groups of 64, over the flat bound of 5.0. The bound is computed from the padded shapes: the config's before
    loading (the memory estimate reads it), the loaded layers' at the audit."""
    from harness.config import build
    from quantizers.torchao import tinygemm_bits

    smol = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
    assert tinygemm_bits(smol, 64) == pytest.approx(7.5)
    assert tinygemm_bits([(4096, 4096), (14336, 4096), (4096, 14336)], 64) == 4.5  # 1024-multiples: no padding
    assert tinygemm_bits([(4, 1024)], 32) == 10.0  # out padded to 8
    _gpu(monkeypatch, A100)
    q = build(compose(FAST + ["quantizer=torchao_int4", "quantizer.kernel=tinygemm", "tracking.enabled=false",
                              "model.num_hidden_layers=1"] + SMOL_WIDTHS)).quantizer
    assert q.max_bits_per_weight == 5.0  # nothing known yet
    q.preflight("cuda")
    assert q.max_bits_per_weight == pytest.approx(7.6)
    packed = TorchAoInt4(kernel="packed", group_size=64)
    assert packed.max_bits_per_weight == 5.0  # the CPU layout stores no padding: its bound stays
