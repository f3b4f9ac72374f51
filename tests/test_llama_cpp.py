"""engine=llama_cpp: config checks and the install hint everywhere; with the extra installed (CI installs it
through scripts/setup.sh --all), a real run and the perplexity truth check against transformers."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from harness.env import wikitext_dir
from harness.errors import QuantbenchError
from harness.measure.prompts import PROMPT_SETS
from harness.models import load_tokenizer
from harness.run import llama_cpp as lc

needs_extra = pytest.mark.skipif(not lc.available(), reason="llama-cpp-python extra not installed "
                                 "(scripts/setup.sh --all installs it; CI does)")
WIKITEXT = wikitext_dir() / "test.txt"  # read in place, never copied


def _build(compose, overrides):
    from harness.config import build

    return build(compose(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["quantizer=bf16"], "quantizer=bf16 is not allowed; use quantizer=none"),
    (["model=tiny_random"], "needs a GGUF model"),
    (["engine.format=Q3_K"], "engine.format='Q3_K' is not allowed; choose one of: gguf"),
    (["measure.cache=static"], "apply to engine=transformers only"),
    (["measure.path=eager"], "engine=llama_cpp: measure.path=eager applies to engine=transformers only"),
    (["measure.gemv=aten"], "engine=llama_cpp: measure.gemv=aten applies to engine=transformers only"),
    (["measure.hugepages=on"], "engine=llama_cpp: measure.hugepages=on applies to engine=transformers only"),
    (["measure.compile_freezing=true", "measure.compile_backend=zentorch"],  # no compiled step to read them
     "engine=llama_cpp: measure.compile_freezing=true, measure.compile_backend=zentorch applies to engine=transformers"),
    (["engine.flash_attn=maybe"], "engine.flash_attn='maybe' must be true or false"),
])
def test_config_errors_are_one_clear_line(compose, overrides, message):
    with pytest.raises(QuantbenchError, match=message.replace("(", r"\(").replace("?", r"\?")):
        _build(compose, ["engine=llama_cpp", *overrides])


def test_auto_settings_pass_on_llama_cpp_so_a_shared_sweep_config_does(compose):
    """conf/experiment/scaling.yaml sets measure.hugepages=auto for every format, llama.cpp's included: `auto`
    means "where it applies", which here is nowhere; only an explicit transformers setting is refused."""
    exp = _build(compose, ["engine=llama_cpp", "measure.hugepages=auto", "measure.gemv=auto", "measure.path=best"])
    assert exp.engine.name == "llama_cpp"


def test_default_engine_is_transformers(compose):
    exp = _build(compose, ["model=tiny_random"])
    assert exp.engine.name == "transformers"


def test_missing_extra_fails_in_preflight_with_install_hint(compose, results_overrides, monkeypatch):
    from harness.run.runner import run

    monkeypatch.setattr(lc, "available", lambda: False)
    res = run(compose(["engine=llama_cpp", "measure.device=cpu", *results_overrides, "tracking.enabled=false"]))
    assert res.status == "FAILED"
    assert "pip install llama-cpp-python" in res.error and "scripts/setup.sh --all" in res.error
    assert "load_s" not in res.metrics  # failed before anything was loaded


def test_kl_is_tagged_unsupported_and_warned_not_dropped_silently(compose, caplog):
    """accuracy.kl=true is the default, and llama.cpp records no KL or top-1: the run says so."""
    from harness.models import byte_tokenizer

    exp = _build(compose, ["engine=llama_cpp", "accuracy.max_tokens=300"])
    assert exp.accuracy.kl
    with caplog.at_level(logging.WARNING, logger="quantbench"):
        record = exp.engine.open(exp, "cpu", 1).references(byte_tokenizer())  # before the model loads
    assert record == ({}, {"accuracy.kl": "unsupported (engine=llama_cpp)"})
    assert "engine=llama_cpp records perplexity only, no KL divergence or top-1 agreement" in caplog.text
    off = _build(compose, ["engine=llama_cpp", "accuracy.max_tokens=300", "accuracy.kl=false"])
    assert off.engine.open(off, "cpu", 1).references(byte_tokenizer()) == ({}, {})


@needs_extra
@pytest.mark.slow
def test_convert_to_q4_0_is_cached(compose, tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    src = _build(compose, ["engine=llama_cpp"]).model.gguf_path
    out = lc.convert(Path(src), "Q4_0", threads=2)
    assert out.is_file() and out != src
    assert lc.linear_bits(out) == pytest.approx(4.5, abs=0.01)  # Q4_0: 18 bytes per 32 weights
    mtime = out.stat().st_mtime_ns
    assert lc.convert(Path(src), "Q4_0", threads=2).stat().st_mtime_ns == mtime  # cached, not rebuilt
    assert lc.linear_bits(Path(src)) == pytest.approx(5.0, abs=0.01)  # the shipped Q4_1: 20 bytes / 32


@needs_extra
@pytest.mark.slow
def test_llama_cpp_run_measures_the_same_metrics(compose, results_overrides):
    from harness.run.runner import run

    res = run(compose(["engine=llama_cpp", "measure.device=cpu", "measure.max_new_tokens=12",
                       "measure.repetitions=1", "measure.warmup=1", "accuracy.max_tokens=600",
                       "accuracy.context_length=256", "accuracy.stride=256", "accuracy.kl=false",
                       *results_overrides, "tracking.enabled=false"]))
    assert res.status == "OK", res.error
    m = res.metrics
    for key in ("ttft_ms", "decode_tokens_per_s", "itl_ms_p50", "itl_ms_p99", "prompt_tokens_per_s", "perplexity",
                "bandwidth_gb_per_s", "bytes_per_step", "roofline_tokens_per_s", "roofline_fraction",
                "achieved_gb_per_s"):
        assert key in m and m[key] > 0, key
    assert m["generated_tokens"] == 4 * 12  # 4 prompts, fixed length, 1 repetition
    assert m["perplexity"] < 100  # a trained model on English text
    assert 0 < m["roofline_fraction"] < 1.5
    assert res.tags["engine"] == "llama_cpp" and "llama.cpp[gguf" in res.tags["kernel_path"]
    # our greedy (logits read with llama_get_logits_ith) == llama.cpp's own greedy sampler, token for token
    # (not compared with transformers: on this prompt the top two logits nearly tie, 24.65 vs 24.74, and
    # llama.cpp's 8-bit activation rounding for Q4_1 flips them)
    import llama_cpp

    exp = _build(compose, ["engine=llama_cpp"])
    prompt = lc.encode_prompts(load_tokenizer(exp.model), PROMPT_SETS["default"][:1], True)[0]
    llm = llama_cpp.Llama(model_path=str(exp.model.gguf_path), n_ctx=512, n_threads=2, logits_all=False,
                          verbose=False)
    try:
        ref = []
        for t in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            ref.append(t)
            if len(ref) == 12:
                break
    finally:
        llm.close()
    assert res.samples[0]["tokens"] == ref
    assert len(set(ref)) > 3  # not a degenerate token-0 stream


def test_batches_hold_a_perplexity_window_and_keep_the_ubatch_the_user_set(compose):
    """n_batch grows to one accuracy window (one decode), n_ubatch stays engine.n_batch (llama_decode splits)."""
    on = _build(compose, ["engine=llama_cpp", "engine.n_batch=64", "accuracy.context_length=256", "accuracy.stride=256"])
    assert on.accuracy.enabled and on.engine.batches(on) == (256, 64)
    off = _build(compose, ["engine=llama_cpp", "engine.n_batch=64", "accuracy.enabled=false"])
    assert off.engine.batches(off) == (64, 64)


def test_system_info_is_trimmed_to_the_features_set():
    raw = b"CPU : SSE3 = 1 | AVX = 1 | AVX512 = 0 | LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
    assert lc.system_info(raw) == "CPU: SSE3 AVX LLAMAFILE OPENMP REPACK"


@needs_extra
@pytest.mark.parametrize("flash_attn", [False, True])
def test_the_task_lm_opens_its_context_with_the_engines_flash_attn(compose, monkeypatch, flash_attn):
    """engine.flash_attn reaches the lm-eval LM's own llama.cpp context (task accuracy) as it reaches the engine's:
    the kwargs it passes to llama_cpp.Llama, caught by a stand-in class (no model loads)."""
    pytest.importorskip("lm_eval")
    import llama_cpp

    class Opened(Exception):
        pass

    seen: list[dict] = []

    class FakeLlama:
        def __init__(self, **kwargs):
            seen.append(kwargs)
            raise Opened

    monkeypatch.setattr(llama_cpp, "Llama", FakeLlama)
    exp = _build(compose, ["engine=llama_cpp", f"engine.flash_attn={str(flash_attn).lower()}"])
    session = exp.engine.open(exp, "cpu", 2)
    session.gguf = Path("model.gguf")
    lm = session.task_lm(tokenizer=None)
    with pytest.raises(Opened):
        lm._loglikelihood_tokens([(("ctx", "cont"), [1, 2], [3])])
    assert seen[0].get("flash_attn") is flash_attn


def test_inject_work_and_slowdown_act_through_injected_step(monkeypatch):
    """measure.inject_work / inject_slowdown stretch llama.cpp's steps as strategies/decode.py's (strategies/inject.py)."""
    import numpy as np

    from strategies.base import DecodeOptions

    class StubLlm:
        n_tokens = 0

        def reset(self):
            self.n_tokens = 0

        def eval(self, toks):
            pass

    calls = []

    def spy(opts, t, dt):
        calls.append((opts.inject_work, opts.inject_slowdown))
        return dt + 1.0

    monkeypatch.setattr(lc, "injected_step", spy)
    s = lc.LlamaCppSession.__new__(lc.LlamaCppSession)
    s.llm, s.depth, s.n_vocab = StubLlm(), 0, 8
    s._logits_last = lambda: np.arange(8.0)
    for kw in ({"inject_work": 0.5}, {"inject_slowdown": 0.25}):
        calls.clear()
        opts = DecodeOptions(device="cpu", max_new_tokens=5, eos_token_id=2, pad_token_id=2, **kw)
        g = s.generate([[1, 2, 3]], opts)
        assert len(calls) == 4 and all(dt >= 1.0 for dt in g.step_s)
    plain = s.generate([[1, 2, 3]], DecodeOptions(device="cpu", max_new_tokens=5, eos_token_id=2, pad_token_id=2))
    assert all(dt < 1.0 for dt in plain.step_s)


def write_tiny_gguf(path: Path, tiny) -> None:
    """The tiny random model as an F32 llama GGUF: the tensors and keys llama.cpp's converter writes, with q and k
    rows permuted to llama.cpp's rotary layout (convert_hf_to_gguf.py's `permute`; transformers undoes it on load).
    The vocabulary is the byte tokenizer's, for llama.cpp to load (one BPE merge, never used: ids go in directly)."""
    import gguf

    from harness.models import byte_tokenizer

    model = tiny.build()
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(cfg.vocab_size)
    vocab = [t for t, _ in sorted(byte_tokenizer().get_vocab().items(), key=lambda kv: kv[1])]
    assert len(vocab) == cfg.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL if i < 3 else gguf.TokenType.NORMAL for i in range(len(vocab))])
    w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"attn_norm": "input_layernorm", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_q.weight", permute(sd[hf + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", permute(sd[hf + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        for ours, theirs in names.items():
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[hf + theirs + ".weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@needs_extra
def test_truth_check_on_a_tiny_gguf(tmp_path):
    """The CI form of the heavy truth check below, in seconds: the tiny random model written as an F32 GGUF,
    perplexity by quantbench (transformers, loading that GGUF) and by llama.cpp (the same file) on the same ids,
    llama-perplexity's second-half rule. F32 on both sides: measured ratio 1.0001 (574.40 vs 574.45)."""
    import llama_cpp
    import torch
    from transformers import AutoModelForCausalLM

    from harness.analysis import accuracy as acc
    from harness.config import AccuracyConfig
    from harness.models import TinyRandom, byte_tokenizer

    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file, TinyRandom())
    cfg = AccuracyConfig(corpus="builtin", max_tokens=512, context_length=128, stride=128, scoring="second_half")
    ids = acc.corpus_tokens(byte_tokenizer(), cfg.corpus, cfg.max_tokens)
    llm = llama_cpp.Llama(model_path=str(gguf_file), n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2,
                          logits_all=False, verbose=False)
    try:
        assert llm.n_vocab() == 259
        theirs = lc.perplexity(llm, ids, cfg)
    finally:
        llm.close()
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=gguf_file.name, dtype=torch.float32).eval()
    ours = acc.score(model, ids, cfg, "cpu")
    assert theirs["scored_tokens"] == ours["scored_tokens"] == 4 * 63
    assert abs(theirs["perplexity"] / ours["perplexity"] - 1) < 0.002, (theirs, ours)
    assert 100 < ours["perplexity"] < 2000  # a random model: near or above the 259-token vocabulary


@pytest.mark.heavy  # heavy tier (make test-heavy): keeps CI well inside 30 min on a cold machine
@needs_extra
@pytest.mark.slow
def test_truth_check_perplexity_matches_llama_cpp_on_the_same_tokens(compose):
    """quantbench (transformers, fp32, model loaded from the GGUF) vs llama.cpp (same GGUF) on the first
    4,096 WikiText-2 tokens, 8 x 512 chunks, llama-perplexity's second-half rule: within 1%."""
    import llama_cpp
    import torch

    from harness.analysis import accuracy as acc
    from harness.models import load_pretrained, load_tokenizer

    assert WIKITEXT.is_file(), f"{WIKITEXT} missing: the shared data folder sits next to the repo"
    exp = _build(compose, ["engine=llama_cpp", f"accuracy.corpus={WIKITEXT}", "accuracy.max_tokens=4096",
                           "accuracy.context_length=512", "accuracy.stride=512", "accuracy.scoring=second_half"])
    tok = load_tokenizer(exp.model)
    ids = acc.corpus_tokens(tok, exp.accuracy.corpus, exp.accuracy.max_tokens)
    assert len(ids) == 4096
    llm = llama_cpp.Llama(model_path=str(exp.model.gguf_path), n_ctx=512, n_batch=512, n_ubatch=512,
                          n_threads=torch.get_num_threads(), logits_all=False, verbose=False)
    try:
        ours_llama = lc.perplexity(llm, ids, exp.accuracy)
    finally:
        llm.close()
    model = load_pretrained(exp.model, "float32", "cpu")
    ours_torch = acc.score(model, ids, exp.accuracy, "cpu")
    assert ours_llama["scored_tokens"] == ours_torch["scored_tokens"] == 8 * 255
    ratio = ours_llama["perplexity"] / ours_torch["perplexity"]
    assert abs(ratio - 1) < 0.01, (ours_llama, ours_torch)
    assert 10 < ours_torch["perplexity"] < 40  # FACTS: ~21.6 for this model and text
