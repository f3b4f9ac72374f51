"""model=random: published 1B-8B shapes with seeded weights, on both engines, with memory that fits (issue 23).

Everything runs on the `tiny` presets (a Llama-3 layout and a Qwen2 layout in miniature) or on the 8B shape
without allocating it (meta device, estimates); the energy counters and the scaling report on data made here.
"""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import warm
from conftest import ROOT, fresh_cache

from harness import cgroup
from harness.analysis import scaling
from harness.config import build
from harness.errors import ConfigError, QuantbenchError
from harness.measure import energy, memory
from harness.models.random_model import BLOCK, IdTokenizer, RandomModel, presets
from harness.records.results import invocation_cells
from harness.run import runner
from harness.sweep.settings import FAULT_ENV, STATE_ENV

needs_llama = pytest.mark.skipif(not __import__("harness.run.llama_cpp", fromlist=["available"]).available(),
                                 reason="llama-cpp-python extra not installed (scripts/setup.sh --all; CI has it)")
QUICK = ["measure.max_new_tokens=4", "measure.repetitions=1", "measure.warmup=0", "measure.kernel_profile=false"]


# ------------------------------------------------------------------------------------------------ shapes
def test_presets_are_the_published_shapes():
    """Parameter counts of the real models (their model cards), from the shipped configs on the meta device."""
    published = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3.1-8b": 8_030_261_248,
                 "qwen2.5-7b": 7_615_616_512}
    assert set(published) <= set(presets())
    for arch, n in published.items():
        counts = memory.model_counts(RandomModel(arch=arch))
        assert counts.params == n, arch
    c8 = memory.model_counts(RandomModel(arch="llama-3.1-8b"))
    assert (c8.layers, c8.kv_heads, c8.head_dim, c8.vocab) == (32, 8, 128, 128256)


def test_weights_are_seeded_bf16_values_the_same_in_memory_and_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    src = RandomModel(arch="tiny", dtype="float32")
    a, b = src.build("float32"), src.build("float32")
    other = RandomModel(arch="tiny", seed=1).build("float32")
    sa, sb = a.state_dict(), b.state_dict()
    for name, t in sa.items():
        assert torch.equal(t, sb[name]), name
        assert torch.equal(t, t.bfloat16().float()), name  # bf16 numbers: an fp32 load and a BF16 GGUF are exact
    w = sa["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(w, other.state_dict()["model.layers.0.mlp.up_proj.weight"])  # the seed matters
    assert 0.015 < float(w.std()) < 0.025 and torch.equal(sa["model.norm.weight"], torch.ones(128))
    assert not torch.equal(w[0], w[1])  # rows start at different shifts of the block (BLOCK is prime)
    assert BLOCK > w.numel()  # the tiny weights are one stretch of the block: no tile repeats inside a matrix
    # quantizers that only load through from_pretrained read the safetensors copy: the same values
    from transformers import AutoModelForCausalLM

    disk = AutoModelForCausalLM.from_pretrained(str(src.local_dir()), dtype=torch.float32).state_dict()
    assert all(torch.equal(t, disk[n]) for n, t in sa.items() if n in disk) and "lm_head.weight" in disk


def test_an_8b_shape_is_never_allocated_to_describe_it():
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    meta = RandomModel(arch="llama-3.1-8b").meta_model()
    assert sum(p.numel() for p in meta.parameters()) == 8_030_261_248 and next(meta.parameters()).is_meta
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 500_000  # KB: no 16 GB appeared


# ------------------------------------------------------------------------------------------- config rules
def test_random_weights_refuse_what_depends_on_values_and_text(compose, tmp_path):
    exp = build(compose(["model=random", "model.arch=tiny"]))
    assert not exp.accuracy.enabled and exp.measure.prompts.startswith("synthetic")  # defaults of model=random
    refused = {
        "accuracy.enabled=true": "perplexity and KL on them mean nothing",
        "strategy=speculative": "acceptance rate",
        "measure.prompts=default": "has no tokenizer",
        "model.arch=llama-9b": "model.arch='llama-9b' is not allowed; choose one of: ",
    }
    for override, needle in refused.items():
        extra = ["measure.prompt_tokens=0"] if override.startswith("measure.prompts") else []
        with pytest.raises(ConfigError) as exc:
            build(compose(["model=random", "model.arch=tiny", override, *extra]))
        assert needle in str(exc.value) and "\n" not in str(exc.value), override
    cfg = json.loads((ROOT / "harness" / "data" / "arch" / "tiny-qwen2.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    exp = build(compose(["model=random", f"model.config_path={tmp_path / 'config.json'}"]))
    assert exp.model.config["model_type"] == "qwen2" and exp.model.tags()["weights"] == "random"
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2' is not supported"):
        build(compose(["model=random", f"model.config_path={tmp_path / 'config.json'}"]))
    # a config the model cannot be built from: refused at config time in one line, not a run FAILED late with
    # KeyError: 'vocab_size', transformers' validator message cut off, or "'list' object has no attribute 'get'"
    broken = {"no sizes": ({"model_type": "llama"}, "vocab_size, hidden_size, intermediate_size, num_hidden_layers, "
                                                    "num_attention_heads must be integers >= 1"),
              "heads": ({**cfg, "hidden_size": 100, "num_attention_heads": 3, "num_key_value_heads": 3},
                        "hidden_size 100 is not divisible by num_attention_heads 3"),
              "kv heads": ({**cfg, "num_key_value_heads": 3}, "must divide num_attention_heads"),
              "list": ([cfg], "is not a JSON config (a JSON list, not an object)")}
    for case, (data, needle) in broken.items():
        (tmp_path / "config.json").write_text(json.dumps(data))
        with pytest.raises(ConfigError) as exc:
            build(compose(["model=random", f"model.config_path={tmp_path / 'config.json'}"]))
        assert needle in str(exc.value) and "\n" not in str(exc.value), (case, str(exc.value))


def test_the_id_tokenizer_gives_ids_and_refuses_text():
    tok = IdTokenizer(512, 1, 2, None)
    assert len(tok) == 512 and tok.all_special_ids == [1, 2] and tok.pad_token_id == 2
    assert tok.decode([5, 2, 7], skip_special_tokens=True) == "ids: 5 7"
    with pytest.raises(QuantbenchError, match="measure.prompts=synthetic"):
        tok("hello")


# ------------------------------------------------------------------------------------------- both engines
@pytest.mark.parametrize("quantizer", ["bf16", "int4"])
def test_runs_on_transformers_with_tags_and_the_memory_estimate(quantizer, compose, results_overrides, tmp_path,
                                                                monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    res = runner.run(compose(["model=random", "model.arch=tiny", f"quantizer={quantizer}", *QUICK,
                              *results_overrides]))
    assert res.status == "OK", res.error
    assert res.tags["weights"] == "random" and res.tags["model.arch"] == "tiny" and res.run_name.startswith("random-tiny")
    assert res.tags["workload.kind"] == "synthetic" and res.samples[0]["output"].startswith("ids: ")
    m = res.metrics
    assert 0 < m["mem_estimate_mb"] < m["mem_available_mb"] and m["peak_mem_mb"] > 0
    assert abs(m["mem_estimate_mb"] - m["peak_mem_mb"]) < 0.5 * m["peak_mem_mb"]  # the runtime dominates at tiny size
    if quantizer == "int4":  # quantized layer by layer through torchao's packed CPU layout
        assert 4.0 <= m["bits_per_weight"] < 5.6 and "Int4" in res.tags["kernel_path"]
    assert res.tags["energy.method"] in ("rapl", "none") and ("energy_j" in m) == (res.tags["energy.method"] == "rapl")


@needs_llama
def test_llama_cpp_runs_the_same_weights_from_its_own_gguf(compose, results_overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    res = runner.run(compose(["model=random", "model.arch=tiny", "engine=llama_cpp", "engine.format=Q4_0",
                              "measure.device=cpu", *QUICK, *results_overrides]))
    assert res.status == "OK", res.error
    assert res.tags["gguf_cache"] == "miss" and res.metrics["gguf_write_s"] > 0 and res.metrics["quantize_s"] > 0
    assert res.tags["engine.format"] == "Q4_0" and res.metrics["bits_per_weight"] == pytest.approx(4.5)
    assert len(list((tmp_path / "gguf").glob("random-tiny-s0-*-BF16*.gguf"))) == 2  # BF16 + its Q4_0, cached
    again = runner.run(compose(["model=random", "model.arch=tiny", "engine=llama_cpp", "engine.format=Q4_0",
                                "measure.device=cpu", *QUICK, *results_overrides]))
    assert again.tags["gguf_cache"] == "hit" and "quantize_s" not in again.metrics
    assert again.tags["workload.hash"] == res.tags["workload.hash"]


@needs_llama
@pytest.mark.parametrize(("hidden", "tied"), [(256, False), (256, True), (128, False)])
def test_the_q4_0_estimate_is_the_size_llama_cpp_writes(hidden, tied, tmp_path, monkeypatch):
    """llama.cpp keeps the head (the embedding when tied) out of Q4_0: Q6_K, Q8_0 where a row is not a multiple of
    256. 4.5 bits everywhere was 19% under the file for a 512-wide 32k-vocab model."""
    from harness.run.llama_cpp import convert

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    cfg = json.loads((ROOT / "harness" / "data" / "arch" / "tiny.json").read_text())
    cfg.update(hidden_size=hidden, intermediate_size=256, vocab_size=16000, num_hidden_layers=1,
               tie_word_embeddings=tied)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    src = RandomModel(config_path=str(tmp_path / "config.json"), dtype="bfloat16")
    from gguf import GGUFReader

    tensors = sum(int(t.n_bytes) for t in GGUFReader(str(convert(src.make_gguf(), "Q4_0", 2))).tensors)
    est = memory.gguf_bytes(memory.model_counts(src), "Q4_0")
    assert est == pytest.approx(tensors, rel=0.01)  # tensor data only: the header and vocabulary are not weights


@needs_llama
def test_llama_cpp_same_format_is_no_conversion_and_the_build_is_tagged(compose, results_overrides, tmp_path,
                                                                        monkeypatch):
    """engine.format equal to the file's own type runs the file itself: no quantize_s, a cache hit once it exists.
    The run records the llama.cpp it used: version, CPU features, batch sizes, attention path (as passed to it)."""
    import llama_cpp

    seen: list[dict] = []
    original = llama_cpp.Llama.__init__

    def init(self, *a, **k):
        seen.append(k)
        original(self, *a, **k)

    monkeypatch.setattr(llama_cpp.Llama, "__init__", init)
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    cfg = ["model=random", "model.arch=tiny", "engine=llama_cpp", "engine.format=BF16", "engine.n_batch=64",
           "measure.device=cpu", *QUICK, *results_overrides]
    first = runner.run(compose(cfg))
    assert first.status == "OK", first.error
    assert first.tags["gguf_cache"] == "miss" and first.metrics["gguf_write_s"] > 0  # the source file was written
    assert "quantize_s" not in first.metrics  # ... but not converted: it is BF16 already
    again = runner.run(compose(cfg))
    assert again.tags["gguf_cache"] == "hit" and "quantize_s" not in again.metrics
    assert (seen[0]["n_batch"], seen[0]["n_ubatch"], seen[0]["flash_attn"]) == (64, 64, False)
    tags = again.tags
    assert (tags["llama.n_batch"], tags["llama.n_ubatch"], tags["llama.flash_attn"]) == ("64", "64", "false")
    assert tags["llama.version"] == llama_cpp.__version__ and tags["llama.system_info"].startswith("CPU:")


@needs_llama
@pytest.mark.parametrize("arch", ["tiny", "tiny-qwen2", "tiny+bias"])
def test_llama_cpp_logits_match_transformers(arch, tmp_path, monkeypatch):
    """The GGUF writer is right (names, q/k permutation, norms, rope_freqs, biases, tied head): llama.cpp's F32
    logits of a short id sequence equal transformers' fp32 ones up to its f16 KV cache. Leaving out the llama
    permutation alone moves them ~0.02 (70x the tolerance), so this check has teeth. "tiny+bias" is the llama
    shape with `attention_bias` and `mlp_bias` (q/k biases take the rows' permutation: without it, 1.1x the
    tolerance; an unmapped bias raised KeyError before)."""
    import llama_cpp

    from harness.run.llama_cpp import convert

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    if arch == "tiny+bias":
        cfg = json.loads((ROOT / "harness" / "data" / "arch" / "tiny.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_bias": True, "mlp_bias": True}))
        src = RandomModel(config_path=str(tmp_path / "config.json"), dtype="float32")
    else:
        src = RandomModel(arch=arch, dtype="float32")
    # 300 seeded ids: at 8 positions a GGUF without rope_freqs still matches (the factors act on long wavelengths);
    # at 300 it is off by ~1e-2 of the logits' range (5x the tolerance), a right export by <= 1.8e-4
    ids = np.random.default_rng(1).integers(3, 500, 300).tolist()
    with torch.no_grad():
        ref = src.build("float32")(torch.tensor([ids])).logits[0].numpy()
    f32 = convert(src.make_gguf(), "F32", 2)
    llm = llama_cpp.Llama(model_path=str(f32), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True, verbose=False,
                          n_threads=2)
    try:
        llm.eval(ids)
        got = np.array(llm.scores[: len(ids)])
    finally:
        llm.close()
    assert np.abs(got - ref).max() < 2e-3 * np.abs(ref).max() and (got.argmax(-1) == ref.argmax(-1)).all()


# ------------------------------------------------------------------------------------------------ memory
def _exp(compose, *overrides):
    exp = build(compose(["model=random", "measure.device=cpu", *overrides]))
    exp.engine.preflight(exp, "cpu")  # resolves int8/int4 to their backend, as before a run
    return exp


def test_the_estimate_counts_weights_in_the_load_dtype_and_the_quantizer_bits(compose):
    est = {q: memory.transformers_estimate(_exp(compose, "model.arch=llama-3.1-8b", f"quantizer={q}"), "cpu")
           for q in ("fp32", "bf16", "int8", "int4")}
    gb = {q: e.parts["weights"] / 1e9 for q, e in est.items()}
    assert gb["fp32"] == pytest.approx(32.12, abs=0.05) and gb["bf16"] == pytest.approx(16.06, abs=0.03)
    assert 9.0 < gb["int8"] < 10.5 and 5.5 < gb["int4"] < 7.5  # the embedding and the head stay bf16
    assert est["int4"].parts["transient"] < 1.0e9  # one bf16 layer + a work copy, never a second model
    assert est["bf16"].parts["KV cache"] == 1 * 32 * 2 * 8 * 128 * 2 * (32 + 64)  # batch, layers, K+V, heads, dim, 2 B, prompt + new


def test_continuous_batching_counts_the_kv_pages_of_every_request(compose):
    """transformers' paged cache holds every request's pages from the start (strategies/continuous_batch.py), not
    one batch's rows: 256 requests of 32 + 256 tokens at the 1B shape are 2.7 GB of KV, not 0.15."""
    shape = ["model.arch=llama-3.2-1b", "strategy=continuous_batch", "measure.prompt_tokens=32",
             "measure.max_new_tokens=256"]
    per_position = 16 * 2 * 8 * 64 * 2  # layers, K+V, kv heads, head dim, bf16
    exp = _exp(compose, *shape, "strategy.requests=256")
    pages = exp.strategy.pages([32 + 256] * 256)  # what generate() hands ContinuousBatchingConfig
    assert pages == 256 * (9 + 1)
    kv = memory.transformers_estimate(exp, "cpu").parts["KV cache"]
    assert kv == per_position * pages * 32 and kv > 2.6e9
    fixed = _exp(compose, *shape, "strategy.requests=256", "strategy.num_blocks=100")
    assert memory.transformers_estimate(fixed, "cpu").parts["KV cache"] == per_position * 100 * 32
    static = _exp(compose, *shape[:1], "strategy=static_batch", "strategy.batch_size=4", *shape[2:])
    assert memory.transformers_estimate(static, "cpu").parts["KV cache"] == per_position * 4 * (32 + 256)


def test_a_tied_head_quantized_to_int8_is_counted_as_its_own_copy(compose):
    """quantizer.head=int8 gives a tied head int8 rows and bf16 scales beside the table the lookup keeps."""
    est = {head: memory.transformers_estimate(_exp(compose, "model.arch=llama-3.2-1b", "quantizer=int4",
                                                   f"quantizer.head={head}", "measure.gemv=aten"), "cpu")
           for head in ("keep", "int8")}
    assert "tied head copy (int8)" not in est["keep"].parts
    assert est["int8"].parts["tied head copy (int8)"] == 128256 * (2048 + 2)
    assert est["int8"].total - est["keep"].total == pytest.approx(128256 * 2050, rel=0.01)


def test_the_fp32_8b_load_is_refused_in_one_line_before_loading(compose, capsys, monkeypatch):
    from harness import cli

    monkeypatch.setattr(memory, "available_bytes", lambda device: (22.0e9, "MemAvailable"))
    monkeypatch.setattr(RandomModel, "build", lambda *a, **k: pytest.fail("nothing may load"))
    cfg = compose(["model=random", "model.arch=llama-3.1-8b", "model.dtype=float32", "tracking.enabled=false"])
    assert cli.run_one(cfg) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: random-llama-3.1-8b") and "22.0 GB is available" in err
    assert "weights 32.1" in err and "quantizer=int4" in err and "smaller model" in err
    with pytest.raises(memory.DoesNotFit):  # a sweep cell: the runner refuses the same way (recorded SKIPPED)
        memory.check(_exp(compose, "model.arch=llama-3.1-8b", "quantizer=fp32"), "cpu")
    assert memory.check(_exp(compose, "model.arch=llama-3.1-8b", "quantizer=int4"), "cpu").total < 12e9


def test_available_memory_takes_a_cgroup_limit(monkeypatch, tmp_path):
    """At the mount root (a cgroup namespace); a process's own cgroup below it: tests/test_cgroup.py."""
    (tmp_path / "memory.max").write_text(str(8 * 2**30))
    (tmp_path / "memory.current").write_text(str(3 * 2**30))
    (tmp_path / "memory.stat").write_text(f"anon {2 * 2**30}\ninactive_file {2**30}\n")  # reclaimable: free
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)
    monkeypatch.setattr(cgroup, "PROC", tmp_path / "no-proc-file")
    avail, how = memory.available_bytes("cpu")
    import psutil

    assert avail == min(6 * 2**30, psutil.virtual_memory().available)
    assert (how == "cgroup limit minus usage") == (avail == 6 * 2**30)
    (tmp_path / "memory.max").write_text("max")
    assert memory.available_bytes("cpu")[1] == "MemAvailable"


# ------------------------------------------------------------------------------------------------ energy
def test_energy_is_absent_without_a_counter_and_computed_from_rapl(tmp_path, monkeypatch):
    meter = energy.EnergyMeter("cpu", powercap=tmp_path / "none")
    meter.start()
    metrics, tags = {}, {}
    meter.record(meter.stop(), 10, metrics, tags)
    assert metrics == {} and tags["energy.method"] == "none" and "no readable RAPL" in tags["energy.why"]

    pkg, core = tmp_path / "intel-rapl:0", tmp_path / "intel-rapl:0:0"  # a package and a sub-domain (not summed)
    for d, v in ((pkg, 999_000_000), (core, 5)):
        d.mkdir()
        (d / "energy_uj").write_text(str(v))
    (pkg / "max_energy_range_uj").write_text("1000000000")
    meter = energy.EnergyMeter("cpu", powercap=tmp_path)
    assert meter.method == "rapl" and [d.name for d in meter.domains] == ["intel-rapl:0"]
    meter.start()
    (pkg / "energy_uj").write_text("4000000")  # wrapped: 1e9 - 999e6 + 4e6 uJ = 5 J
    metrics, tags = {}, {}
    meter.record(meter.stop(), 10, metrics, tags)
    assert metrics == {"energy_j": pytest.approx(5.0), "energy_j_per_token": pytest.approx(0.5)}
    assert tags == {"energy.method": "rapl", "energy.domains": "intel-rapl:0"}
    meter.start()
    with meter.paused():  # work beside what is measured (speculative's greedy reference): left out
        (pkg / "energy_uj").write_text("1000000")  # wrapped inside the pause: 997 J not metered
    (pkg / "energy_uj").write_text("3000000")
    assert meter.stop() == pytest.approx(2.0)


def test_energy_on_cuda_reads_nvml_or_says_why_not(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    meter = energy.EnergyMeter("cuda")
    assert meter.method == "none" and "nvidia-ml-py" in meter.why
    count = iter([1_000.0, 1_000.0, 4_500.0])  # mJ: the probe, start, stop
    fake = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: ("gpu", i),
                           nvmlDeviceGetTotalEnergyConsumption=lambda h: next(count))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    meter = energy.EnergyMeter("cuda:0")
    meter.start()
    assert meter.method == "nvml" and meter.stop() == pytest.approx(3.5)


# ------------------------------------------------------------------------------------------------ scaling
def _row(size, engine, fmt, params, gb, ms, **tags):
    return {"cell": f"{size},{fmt}", "quantizer": fmt if engine == "transformers" else "none", "strategy": "greedy",
            "batch": 1, "depth": 0, "status": "OK", "error": "",
            "tags": {"model.arch": size, "engine": engine, **({"engine.format": fmt} if engine != "transformers"
                                                               else {}), **tags},
            "metrics": {"decode_tokens_per_s": 1e3 / ms, "bytes_per_step": gb * 1e9, "params": params,
                        "bandwidth_gb_per_s": 40.0, "roofline_fraction": gb / 40.0 * 1e3 / ms, "peak_mem_mb": 1024.0,
                        "mem_estimate_mb": 1100.0, "load_s": 3.0}}


def test_the_scaling_section_fits_the_fixed_cost_per_step_and_reads_the_speedups(tmp_path):
    # quantbench: 60 ms + bytes at 20 GB/s; llama.cpp: 2 ms + bytes at 30 GB/s (exact lines: the fit returns them)
    rows = []
    for size, params, gb16 in (("1b", 1.2e9, 2.5), ("8b", 8.0e9, 16.0)):
        for fmt, f in (("bf16", 1.0), ("int8", 0.56), ("int4", 0.34)):
            rows.append(_row(size, "transformers", fmt, params, gb16 * f, 60 + gb16 * f / 20 * 1e3))
            rows[-1]["metrics"]["kernel_stream_gbps"] = 20.0
        for fmt, f in (("BF16", 1.0), ("Q8_0", 0.53), ("Q4_0", 0.28)):
            rows.append(_row(size, "llama_cpp", fmt, params, gb16 * f, 2 + gb16 * f / 30 * 1e3,
                             gguf_cache="hit" if size == "1b" else "miss"))
    # the best path of bf16 at 8B: compiled, faster than eager; speedups are over the fastest 16-bit row
    rows.append(_row("8b", "transformers", "bf16", 8.0e9, 16.0, 700.0, decode_path="compiled"))
    text = scaling.section(rows)
    assert "## Scaling: decode cost against bytes read per step" in text
    assert "| ? | quantbench | all formats | eager | 6 | 60.0 | 20.0 |" in text
    assert "| ? | llama.cpp | all formats | ggml | 6 | 2.0 | 30.0 |" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("| 8b | ? | quantbench | int4 | eager |"))
    cols = [c.strip() for c in line.split("|")[1:-1]]
    assert cols[5] == "8.00 B" and cols[7] == "332.0" and cols[8] == "136.0" and cols[11] == "2.11"  # 700/332
    assert cols[12] == f"{(2 + 16 * 0.28 / 30 * 1e3) / 332:.2f}"  # quantbench int4 over llama.cpp Q4_0
    assert cols[10] == "20.0"
    eager16 = next(ln for ln in text.splitlines() if ln.startswith("| 8b | ? | quantbench | bf16 | eager |"))
    assert eager16.split("|")[12].strip() == f"{700 / 860:.2f}"
    peer = next(ln for ln in text.splitlines() if ln.startswith("| 8b | ? | llama.cpp | Q4_0 | ggml |"))
    assert peer.split("|")[11].strip() == f"{16 * 0.28 / (2 + 16 * 0.28 / 30 * 1e3) * 1e3:.1f} (implied)"
    assert "(cached)" in next(ln for ln in text.splitlines() if ln.startswith("| 1b | ? | llama.cpp | Q8_0 |"))
    assert "- quantbench int4 vs its 16-bit format: 1.5x at 1b, 2x at 8b (best 2.11x at 8b)." in text  # 1b: 1.80x
    # the verdict per format: below 0.75x, and the kernel alone streams below 0.75 of llama.cpp's implied rate
    verdict = next(ln for ln in text.splitlines() if ln.startswith("- 8b, ? threads, int4 (eager):"))
    assert "below 0.75" in verdict and "(the kernel is the gap)" in verdict
    assert "- 8b, ? threads, bf16 (compiled): 700.0 ms/token" in text  # the best path of bf16, not its eager row
    assert scaling.write(tmp_path, rows)[0].stat().st_size > 10_000
    assert scaling.section(rows[:6]) == "" and scaling.write(tmp_path / "x", rows[:6]) == []  # one size: no section
    assert f"| {1024 * 2**20 / 1e9:.1f} ({1100 * 2**20 / 1e9:.1f}) |" in line  # peak MiB shown as GB: 1.1 (1.2)
    # ms/token that does not grow with the bytes (sizes too close, or noise): no fitted number, "undecided"
    flat = [_row("a", "llama_cpp", "BF16", 1e8, 0.20, 5.0), _row("b", "llama_cpp", "BF16", 1.1e8, 0.22, 4.0)]
    fixed = [ln for ln in scaling.section(flat).splitlines() if ln.startswith("| ? | llama.cpp |")]
    assert fixed and all("| undecided | undecided: ms/token does not grow with GB/step" in ln for ln in fixed), fixed


def test_the_scaling_experiment_narrowed_to_the_tiny_presets(tmp_path):
    """`python run.py +experiment=scaling`, two sizes x one format, through the CLI: the report's section and figure."""
    env = {k: v for k, v in os.environ.items() if k not in (FAULT_ENV, STATE_ENV)}
    env["QUANTBENCH_CACHE"] = str(fresh_cache(tmp_path / "cache"))
    done = warm.run(["run.py", "+experiment=scaling", "size=tiny,tiny-qwen2", "format=int4", *QUICK,
                     f"tracking.results_dir={tmp_path}", f"hydra.sweep.dir={tmp_path}/hydra", "tracking.enabled=false"],
                    ROOT, env, tmp_path / "procs", timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    cells = invocation_cells(tmp_path / "scaling")
    assert {c["status"] for c in cells} == {"OK"} and {c["tags"]["model.arch"] for c in cells} == {"tiny", "tiny-qwen2"}
    text = (tmp_path / "scaling" / "report.md").read_text()
    cores = len(os.sched_getaffinity(0))  # measure.threads=0: every core this process may run on
    assert "## Scaling" in text and f"| tiny | {cores} | quantbench | int4 | eager |" in text
    assert f"| tiny-qwen2 | {cores} | quantbench | int4 | eager |" in text
    assert (tmp_path / "scaling" / "scaling.png").is_file()


def test_a_tied_head_is_never_filled_as_a_second_matrix(monkeypatch):
    """With tie_word_embeddings the head is the embedding: it was filled on its own (a second vocab x hidden matrix
    until tie_weights, +0.27 GB at Llama-3.2-1B, beyond the quantized path's memory estimate)."""
    filled: list[str] = []
    real = RandomModel._materialize

    def spy(self, module, prefix, *args, **kwargs):
        filled.append(prefix)
        return real(self, module, prefix, *args, **kwargs)

    monkeypatch.setattr(RandomModel, "_materialize", spy)
    model = RandomModel(arch="tiny-qwen2").build("float32")
    assert "lm_head." not in filled and "model.embed_tokens." in filled
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    filled.clear()
    untied = RandomModel(arch="tiny").build("float32")  # an untied head is its own matrix, filled
    assert "lm_head." in filled and untied.lm_head.weight is not untied.get_input_embeddings().weight


def test_the_scaling_figure_fits_one_line_per_thread_count_and_path(tmp_path, monkeypatch):
    """The figure fitted one line over an engine's rows of every thread count and path: 2-thread rows on
    5 ms + GB / 20 GB/s plus the sweep's 1-thread 1B row drew "62.7 ms + bytes / 31 GB/s"."""
    from harness.analysis import figures
    from harness.records.rows import describe

    cpu = {"cpu.vendor": "AuthenticAMD", "cpu.family": "25", "cpu.model": "17"}

    def cell(size, params, threads, tps, gb):
        return {"status": "OK", "metrics": {"decode_tokens_per_s": tps, "bytes_per_step": gb * 1e9, "params": params,
                                            "bandwidth_gb_per_s": 20.0},
                "tags": {"sweep.cell": f"{size}-{threads}", "model.name": size, "model.arch": size,
                         "quantizer.name": "int8", "engine": "transformers", "threads": str(threads),
                         "decode_path": "best", **cpu}}

    rows = [describe(c) for c in (cell("1b", 1.2e9, 2, 1e3 / 70, 1.3), cell("3b", 3.2e9, 2, 1e3 / 170, 3.3),
                                  cell("1b", 1.2e9, 1, 1e3 / 140, 1.3))]
    labels: list[str] = []
    save = figures.save
    monkeypatch.setattr(figures, "save", lambda fig, path, dpi=None: (labels.extend(
        ln.get_label() for ax in fig.axes for ln in ax.get_lines() if "fit" in ln.get_label()), save(fig, path))[1])
    scaling.write(tmp_path, rows)
    assert labels == ["quantbench best 2t fit: 5.0 ms + bytes / 20 GB/s"]
