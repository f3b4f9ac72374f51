"""Roofline: the calculator, bytes-per-step accounting, bandwidth caching, metrics on a run, slow-kernel flag."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import FAST, fresh_cache

from harness import env
from harness.analysis import bandwidth, roofline
from harness.errors import ConfigError
from harness.models import TinyRandom


def test_calculator_7b_fp16_on_h100_bandwidth(capsys):
    assert roofline.main(["--params", "7e9", "--bits", "16", "--bandwidth", "3.35e12"]) == 0
    out = capsys.readouterr().out
    ms = float(out.split("floor")[1].split("ms/token")[0])
    assert ms == pytest.approx(4.18, abs=0.01)  # 14 GB / 3.35 TB/s
    assert roofline.floor(7e9, 16, 3.35e12)["tokens_per_s"] == pytest.approx(239.3, abs=0.1)
    # the named device gives the same floor and cites its source
    roofline.main(["--params", "7e9", "--bits", "16", "--device", "h100"])
    named = capsys.readouterr().out
    assert "4.18 ms/token" in named and "datasheet" in named


def test_calculator_batch_and_kv_cache():
    base = roofline.floor(7e9, 4, 1e12)
    # batch 8 reading a 4096-token KV cache of 32 layers x 1024 dims in 16 bits: 8*4096*2*32*1024*2 bytes
    f = roofline.floor(7e9, 4, 1e12, batch=8, context=4096, layers=32, kv_dim=1024, kv_bits=16)
    assert f["bytes_per_step"] - base["bytes_per_step"] == 8 * 4096 * 2 * 32 * 1024 * 2
    assert f["tokens_per_s"] == pytest.approx(8 * 1e12 / f["bytes_per_step"])


def test_calculator_rejects_bad_input(capsys):
    with pytest.raises(SystemExit):
        roofline.main(["--params", "7e9", "--device", "abacus"])
    assert "choose one of" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        roofline.main(["--params", "7e9", "--bandwidth", "1e12", "--context", "100"])
    assert "--layers" in capsys.readouterr().err


@pytest.mark.parametrize("arg,value", [("--layers", "-32"), ("--kv-dim", "0"), ("--kv-bits", "-16")])
def test_calculator_refuses_a_kv_size_that_is_not_positive(arg, value, capsys):
    """A negative KV size took bytes off the weights' (a floor faster than reading the weights alone)."""
    kv = {"--layers": "32", "--kv-dim": "1024", "--kv-bits": "16", arg: value}
    with pytest.raises(SystemExit):
        roofline.main(["--params", "7e9", "--bandwidth", "1e12", "--context", "4096",
                       *[x for k, v in kv.items() for x in (k, v)]])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith("--layers, --kv-dim and --kv-bits must be > 0 and --context >= 0")
    assert roofline.main(["--params", "7e9", "--bandwidth", "1e12"]) == 0  # no KV cache: none of them needed


def _unique_param_bytes(model) -> int:
    seen = {id(p): p for p in model.parameters()}
    return sum(p.numel() * p.element_size() for p in seen.values()) + sum(
        b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.parametrize("tied", [True, False])
def test_bytes_per_step_on_tiny_model(tied):
    src = TinyRandom(tie_word_embeddings=tied)
    model = src.build()
    shape = roofline.shape_from_torch(model)
    stored = _unique_param_bytes(model)
    emb = src.hidden_size * 259 * 4  # vocab 259, fp32
    row = src.hidden_size * 4
    assert shape.tied is tied and shape.weight_bytes == stored and shape.embed_bytes == emb
    # K and V, per layer, per KV head, fp32: 2 * 2 * 2 * 32 * 4
    head_dim = src.hidden_size // src.num_attention_heads
    kv_tok = 2 * src.num_hidden_layers * src.num_key_value_heads * head_dim * 4
    assert shape.kv_bytes_per_token == kv_tok
    batch, ctx = 3, 10.5
    expect = stored + batch * row + batch * kv_tok * ctx if tied else stored - emb + batch * row + batch * kv_tok * ctx
    assert roofline.bytes_per_step(shape, batch, ctx) == pytest.approx(expect)
    # bf16 halves every weight byte and the KV element size
    half = roofline.shape_from_torch(model.to(torch.bfloat16))
    assert half.weight_bytes == pytest.approx(stored / 2, rel=0.01) and half.kv_elem_bytes == 2


def test_mean_context_counts_the_new_token_and_padding():
    # width 10, 4 steps: the steps attend over 11, 12, 13, 14 positions
    assert roofline.mean_context([(10, 4)]) == pytest.approx(12.5)
    assert roofline.mean_context([(10, 4), (2, 2)]) == pytest.approx((11 + 12 + 13 + 14 + 3 + 4) / 6)
    assert roofline.mean_context([]) == 0.0


def test_bandwidth_cached_per_thread_count_and_keeps_the_highest(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    values = iter([20e9, 30e9, 10e9, 50e9])
    calls = []

    def fake(threads, repeats=5):
        calls.append(threads)
        return bandwidth.Bandwidth(next(values), f"fake {threads}", 1.0)

    monkeypatch.setattr(bandwidth, "measure_cpu", fake)
    assert bandwidth.host_bandwidth("cpu", 2).bytes_per_s == 20e9
    assert bandwidth.host_bandwidth("cpu", 2).bytes_per_s == 20e9  # cached: no second measurement
    assert bandwidth.host_bandwidth("cpu", 1).bytes_per_s == 30e9  # other thread count, own entry
    assert calls == [2, 1]
    assert bandwidth.host_bandwidth("cpu", 2, refresh=True).bytes_per_s == 20e9  # 10 < 20: contention, kept
    assert bandwidth.host_bandwidth("cpu", 2, refresh=True).bytes_per_s == 50e9
    assert len(list((tmp_path / "roofline").glob("bandwidth-*.json"))) == 2


def test_bandwidth_key_tells_cpus_apart_and_another_boot_measures_anew(monkeypatch, tmp_path):
    """VMs name every host "vm" and Zen 3, 4 and 5 "AMD EPYC": the key holds family, model and ISA tier. The value
    kept on a refresh is the higher one only on the same boot (contention); another boot may be another machine."""
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    zen3 = env.CpuInfo("AuthenticAMD", "25", "1", "AMD EPYC", frozenset({"avx2", "fma"}))
    zen4 = env.CpuInfo("AuthenticAMD", "25", "17", "AMD EPYC", frozenset({"avx2", "fma", "avx512f"}))
    keys = set()
    for cpu in (zen3, zen4):
        monkeypatch.setattr(bandwidth.env, "cpu_info", lambda with_torch=True, cpu=cpu: cpu)
        keys.add(bandwidth.host_key("cpu", 2))
    assert len(keys) == 2
    values = iter([50e9, 20e9, 10e9])
    monkeypatch.setattr(bandwidth, "measure_cpu", lambda threads, repeats=5: bandwidth.Bandwidth(next(values), "f"))
    monkeypatch.setattr(bandwidth, "boot_id", lambda: "boot-1")
    assert bandwidth.host_bandwidth("cpu", 2).bytes_per_s == 50e9
    monkeypatch.setattr(bandwidth, "boot_id", lambda: "boot-2")
    assert bandwidth.host_bandwidth("cpu", 2, refresh=True).bytes_per_s == 20e9  # not the other machine's 50
    assert bandwidth.host_bandwidth("cpu", 2, refresh=True).bytes_per_s == 20e9  # same boot: 10 is contention


def test_the_speeds_cache_compares_with_the_last_hours_only(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    group = {"model": "m", "engine": "e"}
    heavy = {"bytes_per_step": 270e6, "decode_tokens_per_s": 40.0, "roofline_fraction": 0.6}
    light = {"bytes_per_step": 100e6, "decode_tokens_per_s": 17.0, "roofline_fraction": 0.04}
    now = roofline.time.time()
    monkeypatch.setattr(roofline.time, "time", lambda: now - 13 * 3600)  # yesterday's bf16 run
    assert roofline.check_slow_kernel(group, "bf16", heavy, "cpu", 2) is None
    monkeypatch.setattr(roofline.time, "time", lambda: now)
    assert roofline.check_slow_kernel(group, "int4", light, "cpu", 2) is None  # other software, maybe: not compared
    assert "slow kernel path?" in roofline.check_slow_kernel(group, "bf16", heavy, "cpu", 2)


def test_real_cpu_bandwidth_measurement():
    bw = bandwidth.measure_cpu(threads=1, repeats=2)
    assert 1e9 < bw.bytes_per_s < 2e12
    assert "read" in bw.method and "copy" in bw.method and "triad" in bw.method and "1 threads" in bw.method


def test_slow_kernel_flags_lighter_format_not_faster():
    rows = [
        {"group": "g", "label": "bf16", "bytes_per_step": 270e6, "decode_tokens_per_s": 40.0, "roofline_fraction": 0.3},
        {"group": "g", "label": "int4", "bytes_per_step": 100e6, "decode_tokens_per_s": 17.0, "roofline_fraction": 0.04},
        {"group": "g", "label": "int8", "bytes_per_step": 150e6, "decode_tokens_per_s": 80.0, "roofline_fraction": 0.3},
        {"group": "h", "label": "other", "bytes_per_step": 50e6, "decode_tokens_per_s": 1.0, "roofline_fraction": 0.01},
    ]
    flags = roofline.slow_kernel_flags(rows)
    assert set(flags) == {1}  # int4: lighter than bf16 and slower; int8 is faster than everything heavier
    assert flags[1].startswith(roofline.SLOW_TAG) and "bf16" in flags[1]
    rows[1]["roofline_fraction"] = 0.6  # at more than the stated fraction of its bound: not a kernel problem
    assert roofline.slow_kernel_flags(rows) == {}


def test_check_slow_kernel_compares_with_runs_recorded_on_this_host(monkeypatch, tmp_path):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    group = {"model": "m", "engine": "e"}
    heavy = {"bytes_per_step": 270e6, "decode_tokens_per_s": 40.0, "roofline_fraction": 0.6}
    light = {"bytes_per_step": 100e6, "decode_tokens_per_s": 17.0, "roofline_fraction": 0.04}
    assert roofline.check_slow_kernel(group, "bf16", heavy, "cpu", 2) is None
    assert "slow kernel path?" in roofline.check_slow_kernel(group, "int4", light, "cpu", 2)
    assert roofline.check_slow_kernel({**group, "model": "other"}, "int4", light, "cpu", 2) is None
    # a third, heavier run that outpaces the slow light one: the warning names this run, not the first heavy one
    third = roofline.check_slow_kernel(group, "fp32", {**heavy, "bytes_per_step": 540e6}, "cpu", 2)
    assert "int4 reads 100 MB/step" in third and "not faster than fp32 (540 MB/step" in third, third


def test_roofline_plot_writes_png(tmp_path):
    rows = [{"label": "bf16", "decode_tokens_per_s": 40.0, "roofline_tokens_per_s": 140.0},
            {"label": "nan", "decode_tokens_per_s": math.nan, "roofline_tokens_per_s": 1.0}]
    path = roofline.roofline_plot(rows, tmp_path / "roofline.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_metrics_present_on_a_tiny_run(compose, results_overrides, monkeypatch, tmp_path):
    from harness.run.runner import run

    monkeypatch.setenv("QUANTBENCH_CACHE", str(fresh_cache(tmp_path / "cache")))
    threads = 1
    # a known bandwidth in this host's cache: the run must use it and not measure
    path = tmp_path / "cache" / "roofline" / f"bandwidth-{bandwidth.host_key('cpu', threads)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"bytes_per_s": 10e9, "method": "seeded by the test"}))
    monkeypatch.setattr(bandwidth, "measure_cpu", lambda *a, **k: pytest.fail("bandwidth measured again"))
    res = run(compose(FAST + results_overrides + ["measure.device=cpu", f"measure.threads={threads}",
                                                  "accuracy.enabled=false", "tracking.enabled=false"]))
    assert res.status == "OK", res.error
    m = res.metrics
    assert m["bandwidth_gb_per_s"] == pytest.approx(10.0)
    assert res.tags["bandwidth_method"] == "seeded by the test"
    shape = roofline.shape_from_torch(TinyRandom().build())
    # the default prompt set through the byte tokenizer: KV read at the mean context of the decode
    assert m["bytes_per_step"] == pytest.approx(roofline.bytes_per_step(shape, 1, m["kv_context_mean"]))
    assert m["kv_context_mean"] > 8
    assert m["roofline_tokens_per_s"] == pytest.approx(10e9 / m["bytes_per_step"])
    assert m["roofline_fraction"] == pytest.approx(m["decode_tokens_per_s"] / m["roofline_tokens_per_s"])
    assert m["achieved_gb_per_s"] == pytest.approx(m["decode_tokens_per_s"] * m["bytes_per_step"] / 1e9)


def test_second_half_scoring_rule():
    from harness.analysis.accuracy import windows
    from harness.config import AccuracyConfig

    # llama-perplexity: 8 chunks of 512 -> 255 scored tokens each (first half is context only)
    spans = windows(4096, 512, 512, "second_half")
    assert spans == [(i * 512, (i + 1) * 512, 255) for i in range(8)]
    assert sum(n for *_, n in windows(4096, 512, 512)) == 8 * 511
    # whole chunks only, as llama-perplexity (n_tokens / n_ctx chunks): a 76-token tail would score 37 tokens
    # with 39-75 tokens of context, not the half window the rule promises
    assert windows(1100, 512, 512, "second_half") == [(0, 512, 255), (512, 1024, 255)]
    assert windows(500, 512, 512, "second_half") == []
    with pytest.raises(ConfigError, match="stride"):
        AccuracyConfig(scoring="second_half", stride=256, context_length=512)
    with pytest.raises(ConfigError, match="choose one of"):
        AccuracyConfig(scoring="halves")


def test_sweep_report_gains_roofline_column_and_plot(tmp_path):
    from harness.records import report

    cells = [{"status": "OK", "run_name": name, "tags": {"quantizer.name": q, "strategy.name": "Greedy"},
              "metrics": {"decode_tokens_per_s": tps, "roofline_tokens_per_s": bound,
                          "roofline_fraction": tps / bound}}
             for name, q, tps, bound in (("a", "none", 40.0, 140.0), ("b", "int4", 17.0, 300.0))]
    paths = report.write_report(tmp_path, cells, "none", "t")
    text = paths[0].read_text()
    assert "bound tok/s" in text and "| 0.057 |" in text and "| 300 |" in text
    assert (tmp_path / "roofline.png") in paths and (tmp_path / "roofline.png").read_bytes()[:4] == b"\x89PNG"


def test_a_static_cache_is_read_whole_every_step(compose, results_overrides, monkeypatch, tmp_path):
    """transformers' StaticLayer.update hands attention the whole buffer, so with measure.cache=static each step
    reads width + max_new_tokens positions, not width + i + 1: 8 new tokens = 7 steps reading width + 1..7 on
    a dynamic cache (mean width + 4) against width + 8 on a static one, on every call of the same prompts."""
    from harness.run.runner import run

    monkeypatch.setenv("QUANTBENCH_CACHE", str(fresh_cache(tmp_path / "cache")))
    path = tmp_path / "cache" / "roofline" / f"bandwidth-{bandwidth.host_key('cpu', 1)}.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"bytes_per_s": 10e9, "method": "seeded by the test"}))
    base = FAST + results_overrides + ["measure.device=cpu", "measure.threads=1", "accuracy.enabled=false",
                                       "tracking.enabled=false", "measure.stop_at_eos=false"]
    dynamic, static = (run(compose([*base, f"measure.cache={c}"])) for c in ("dynamic", "static"))
    assert dynamic.status == static.status == "OK", (dynamic.error, static.error)
    assert static.metrics["kv_context_mean"] == pytest.approx(dynamic.metrics["kv_context_mean"] + 4)
    assert static.metrics["bytes_per_step"] > dynamic.metrics["bytes_per_step"]


def test_fixed_context_weights_each_length_by_its_steps():
    assert roofline.fixed_context([(20, 3), (40, 1)]) == pytest.approx((60 + 40) / 4)
    assert roofline.fixed_context([]) == 0.0
