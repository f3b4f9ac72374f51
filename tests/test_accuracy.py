"""KL divergence against the reference: the exact record matches a full-vocabulary KL computed here, the
top-k record is a lower bound with an honest bound on what it hides, and stale records are never misread.

The tiny model's vocabulary (259) is larger than the k used here (8), so the top-k bucket loses real KL.
"""

from __future__ import annotations

import logging

import pytest
import torch

from harness.analysis import accuracy as acc
from harness.analysis import intervals, output_layer
from harness.config import build
from harness.errors import ConfigError
from tests.conftest import FAST

K = 8


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    """A private cache root: this file's records never meet anyone else's."""
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _setup(compose, *overrides):
    from harness.models import load_tokenizer

    exp = build(compose([*FAST, f"accuracy.kl_top_k={K}", *overrides]))
    tok = load_tokenizer(exp.model)
    return exp, tok, acc.corpus_tokens(tok, exp.accuracy.corpus, exp.accuracy.max_tokens)


@torch.inference_mode()
def _full_vocab(ref_model, model, ids, cfg):
    """Per scored token: full-vocabulary KL(ref || model) in float64, ref tail mass outside its top-K,
    whether the argmaxes agree. Written without harness.analysis.accuracy's KL code."""
    kl, tail, agree = [], [], []
    x = torch.tensor(ids)[None]
    for begin, end, n in acc.windows(len(ids), cfg.context_length, cfg.stride, cfg.scoring):
        lp = torch.log_softmax(ref_model(input_ids=x[:, begin:end]).logits[0, -n - 1:-1].double(), -1)
        lq = torch.log_softmax(model(input_ids=x[:, begin:end]).logits[0, -n - 1:-1].double(), -1)
        kl.append((lp.exp() * (lp - lq)).sum(-1))
        tail.append(1 - lp.exp().topk(K, -1).values.sum(-1))
        agree.append((lp.argmax(-1) == lq.argmax(-1)).double())
    return torch.cat(kl), torch.cat(tail), torch.cat(agree)


def test_exact_kl_equals_full_vocabulary_kl(compose, cache):
    """Fails with the top-k-only record: bf16 rounding spreads KL over the whole vocabulary."""
    from harness.models import load_pretrained

    exp, tok, ids = _setup(compose)
    reference, hit = acc.ensure_reference(exp.model, tok, exp.accuracy, "cpu")
    assert not hit and reference["meta"]["mode"] == "exact"
    assert reference["hidden"].shape == (acc._n_scored(len(ids), exp.accuracy), exp.model.hidden_size)
    ref_model = load_pretrained(exp.model, "float32", "cpu")
    model = load_pretrained(exp.model, "bfloat16", "cpu")
    got = acc.score(model, ids, exp.accuracy, "cpu", reference=reference)
    kl, _, agree = _full_vocab(ref_model, model, ids, exp.accuracy)
    assert kl.mean() > 1e-5  # bf16 really differs
    assert got["kl_div_mean"] == pytest.approx(float(kl.mean()), rel=1e-6)
    assert got["kl_div_p99"] == pytest.approx(float(torch.quantile(kl, 0.99)), rel=1e-6)
    assert got["top1_agreement"] == pytest.approx(float(agree.mean()), abs=1e-12)
    assert got["kl_ref_tail_mass"] == 0.0 and got["kl_div_tail_bound"] == 0.0
    # the interval is the block bootstrap of these per-token KLs (harness/analysis/intervals.py), around the mean
    assert (got["kl_div_mean_lo"], got["kl_div_mean_hi"]) == pytest.approx(
        intervals.block_bootstrap_mean(kl.double().numpy()), rel=1e-6)
    assert got["kl_div_mean_lo"] < got["kl_div_mean"] < got["kl_div_mean_hi"]
    # the reference against its own record: exactly 0, not a rounding residue
    same = acc.score(ref_model, ids, exp.accuracy, "cpu", reference=reference)
    assert same["kl_div_mean"] == 0.0 and same["top1_agreement"] == 1.0
    assert same["perplexity"] == pytest.approx(float(reference["perplexity"][0]), rel=1e-12)


def test_topk_record_is_a_lower_bound_with_a_true_upper_bound(compose, cache):
    from harness.models import load_pretrained

    exp, tok, ids = _setup(compose, "accuracy.kl_reference=topk")
    reference, _ = acc.ensure_reference(exp.model, tok, exp.accuracy, "cpu")
    assert reference["meta"]["mode"] == "topk" and "hidden" not in reference
    ref_model = load_pretrained(exp.model, "float32", "cpu")
    model = load_pretrained(exp.model, "bfloat16", "cpu")
    got = acc.score(model, ids, exp.accuracy, "cpu", reference=reference)
    kl, tail, _ = _full_vocab(ref_model, model, ids, exp.accuracy)
    assert got["kl_div_mean"] < 0.9 * float(kl.mean())  # the bucket hides real KL here ...
    assert float(kl.mean()) <= got["kl_div_mean"] + got["kl_div_tail_bound"]  # ... but no more than it says
    assert got["kl_ref_tail_mass"] == pytest.approx(float(tail.mean()), rel=1e-6)


def test_tail_bound_holds_per_token_and_is_attained():
    """`_kl_topk` on hand-made distributions: KL_topk <= KL <= KL_topk + bound, with equality on the right
    for the worst tail (every tail probability at the cap, on the smallest q)."""
    torch.manual_seed(0)
    vocab, k = 40, 4
    q_logits = torch.randn(64, vocab, dtype=torch.float64) * 3
    lq = torch.log_softmax(q_logits, -1)
    p = torch.softmax(torch.randn(64, vocab, dtype=torch.float64) * 3, -1)
    # the last row: the worst case the bound describes (stored tokens 0..3, cap 0.06 on the smallest q)
    worst = torch.zeros(vocab, dtype=torch.float64)
    worst[:k] = torch.tensor([0.5, 0.2, 0.1, 0.06], dtype=torch.float64)
    order = lq[-1, k:].argsort() + k
    worst[order[:2]], worst[order[2]] = 0.06, 0.08 - 0.06  # 2 at the cap, the remainder 0.02 on the third
    p[-1] = worst
    idx = p.topk(k, -1).indices
    idx[-1] = torch.arange(k)
    r_lp = p.log().gather(-1, idx)
    kl_k, tail, bound = acc._kl_topk(r_lp, idx, q_logits)
    full = (torch.xlogy(p, p) - p * lq).sum(-1)
    assert torch.all(kl_k <= full + 1e-12) and torch.all(full <= kl_k + bound + 1e-12)
    assert tail[-1] == pytest.approx(0.14, abs=1e-12)
    assert float(kl_k[-1] + bound[-1]) == pytest.approx(float(full[-1]), rel=1e-9)


def test_topk_covering_the_whole_vocabulary_is_the_plain_kl():
    """kl_top_k >= the vocabulary: no tail, so the plain KL (the tail term was Q's log 0 = inf)."""
    torch.manual_seed(1)
    vocab = 40
    q_logits = torch.randn(16, vocab, dtype=torch.float64) * 3
    lp = torch.log_softmax(torch.randn(16, vocab, dtype=torch.float64) * 3, -1)
    r_lp, idx = lp.topk(vocab, -1)
    kl_k, tail, bound = acc._kl_topk(r_lp, idx, q_logits)
    full = (lp.exp() * (lp - torch.log_softmax(q_logits, -1))).sum(-1)
    assert torch.isfinite(kl_k).all()
    assert kl_k.tolist() == pytest.approx(full.tolist(), rel=1e-9)
    assert tail.abs().max() == 0 and bound.abs().max() == 0


def _gemma2(path, softcap, init):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from harness.models import byte_tokenizer

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, final_logit_softcapping=softcap,
                          initializer_range=init, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Gemma2ForCausalLM(config).save_pretrained(path)
    tok = byte_tokenizer()
    tok.save_pretrained(path)
    return tok


def test_softcap_in_the_config_refuses_the_exact_record_in_bf16(cache, tmp_path, caplog):
    """Gemma 2's default softcap (30) on small logits: in bf16 the recomputed logits missed the model's by less
    than the old tolerance (4 bf16 eps x max|logit|, ~3%), the record was "exact" and the reference scored a
    non-zero KL against itself. The config names the softcap: top-k, with the warning."""
    from harness.config import AccuracyConfig
    from harness.models import HFModel, load_pretrained

    tok = _gemma2(tmp_path / "gemma2", 30.0, 0.1)
    source = HFModel(name_or_path=str(tmp_path / "gemma2"), dtype="bfloat16")
    cfg = AccuracyConfig(max_tokens=200, context_length=64, stride=64, reference_dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="quantbench"):
        reference, _ = acc.ensure_reference(source, tok, cfg, "cpu")
    assert reference["meta"]["mode"] == "topk"
    assert "final_logit_softcapping=30.0" in caplog.text
    ids = acc.corpus_tokens(tok, cfg.corpus, cfg.max_tokens)
    same = acc.score(load_pretrained(source, "bfloat16", "cpu"), ids, cfg, "cpu", reference=reference)
    assert same["kl_div_mean"] < 1e-9 and same["top1_agreement"] == 1.0


def test_exact_check_admits_one_rounding_not_a_softcap():
    """`within_rounding` in bf16: a neighbouring value passes, a softcap that moves the largest logit by 2.3%
    (under the old 4 x eps x max|logit| = 3.1%) does not."""
    own = torch.linspace(-8, 8, 257).to(torch.bfloat16)[None]
    assert output_layer.within_rounding(own.clone(), own, 8.0) == 0.0
    up = torch.nextafter(own, torch.full_like(own, float("inf")))  # one bf16 ulp above every logit
    assert output_layer.within_rounding(up, own, 8.0) <= 1.0
    capped = (30 * torch.tanh(own.float() / 30)).to(torch.bfloat16)
    assert float((capped.float() - own.float()).abs().max()) <= 4 * torch.finfo(torch.bfloat16).eps * 8
    assert output_layer.within_rounding(capped, own, 8.0) > 1.0


def test_a_16_bit_reference_of_a_plain_model_stays_exact(compose, cache):
    from harness.models import load_pretrained

    exp, tok, ids = _setup(compose, "accuracy.reference_dtype=bfloat16")
    reference, _ = acc.ensure_reference(exp.model, tok, exp.accuracy, "cpu")
    assert reference["meta"]["mode"] == "exact"
    same = acc.score(load_pretrained(exp.model, "bfloat16", "cpu"), ids, exp.accuracy, "cpu", reference=reference)
    assert same["kl_div_mean"] == 0.0


def test_softcapped_logits_fall_back_loudly_to_topk(cache, tmp_path, caplog):
    """A model whose logits are not Linear(hidden) (Gemma 2's final_logit_softcapping) cannot have an exact
    record: the reference pass notices, warns, and stores the top-k record with its bound instead."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from harness.config import AccuracyConfig
    from harness.models import HFModel, byte_tokenizer

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, final_logit_softcapping=2.0,
                          initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path / "gemma2")
    tok = byte_tokenizer()
    tok.save_pretrained(tmp_path / "gemma2")
    source = HFModel(name_or_path=str(tmp_path / "gemma2"), dtype="float32")
    cfg = AccuracyConfig(max_tokens=200, context_length=64, stride=64, kl_top_k=K)
    with caplog.at_level(logging.WARNING, logger="quantbench"):
        reference, _ = acc.ensure_reference(source, tok, cfg, "cpu")
    assert reference["meta"]["mode"] == "topk"
    assert "exact KL is not available" in caplog.text and "softcapping" in caplog.text


def test_old_or_stale_records_are_rebuilt_not_misread(compose, cache):
    from safetensors.torch import save_file

    exp, tok, ids = _setup(compose)
    path = acc.reference_path(exp.model.identity(), exp.accuracy)
    n = acc._n_scored(len(ids), exp.accuracy)
    # the layout before the exact record (top-k only, no format metadata), at this very path
    save_file({"top_lp": torch.zeros(n, K), "top_idx": torch.zeros(n, K, dtype=torch.int32),
               "argmax": torch.zeros(n, dtype=torch.long), "perplexity": torch.ones(1, dtype=torch.float64)},
              str(path.parent.mkdir(parents=True, exist_ok=True) or path))
    reference, hit = acc.ensure_reference(exp.model, tok, exp.accuracy, "cpu")
    assert not hit and reference["meta"]["mode"] == "exact"
    assert acc.ensure_reference(exp.model, tok, exp.accuracy, "cpu")[1]  # now a hit
    # a record whose output layer no longer matches the model directory is rebuilt too
    tensors = {k: v for k, v in reference.items() if k != "meta"}
    meta = {k: v for k, v in reference["meta"].items() if k not in ("path", "model_dir", "format")}
    acc.save_reference(path, tensors, {**meta, "head_sha256_weight": "0" * 64})
    assert not acc.ensure_reference(exp.model, tok, exp.accuracy, "cpu")[1]
    # the record format and the new setting are part of the key
    other = build(compose([*FAST, f"accuracy.kl_top_k={K}", "accuracy.kl_reference=topk"])).accuracy
    assert acc.reference_path(exp.model.identity(), other) != path


def test_a_corpus_leaving_no_token_to_score_is_one_line(compose, tmp_path):
    """second_half scores nothing in a 2-token chunk: score() divided by zero scored tokens, after the timing."""
    from harness.errors import QuantbenchError
    from harness.models import load_tokenizer

    (tmp_path / "two.txt").write_text("ab")  # two tokens of the tiny model's byte tokenizer
    exp = build(compose([*FAST, "accuracy.scoring=second_half", "accuracy.stride=128", "accuracy.kl=false",
                         f"accuracy.corpus={tmp_path / 'two.txt'}"]))
    assert acc.windows(2, 128, 128, "second_half") == []
    match = "its 2 tokens leave none to score with accuracy.scoring=second_half"
    with pytest.raises(QuantbenchError, match=match):
        acc.score(None, [5, 6], exp.accuracy, "cpu")
    with pytest.raises(QuantbenchError, match=match):  # the engine's first hook, before the model loads
        exp.engine.open(exp, "cpu", 1).references(load_tokenizer(exp.model))


def test_runs_tag_what_the_unquantized_reference_is_stored_as(compose, cache, tmp_path):
    """The default model's "unquantized" reference is its Q4_1 GGUF dequantized: every KL is a distance from a
    Q4_1 model, and the run says so (tag reference.source)."""
    from safetensors.torch import save_file

    from harness.models import EmbeddedGGUF, HFModel, load_tokenizer

    assert EmbeddedGGUF().reference_source() == "gguf:Q4_1+Q8_0"  # blocks Q4_1, token embedding Q8_0
    save_file({"a": torch.zeros(4, 4, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.float32)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text('{"quantization_config": {"quant_method": "gptq"}}')
    (tmp_path / "tokenizer.json").write_text("{}")  # only its presence is checked here
    assert HFModel(name_or_path=str(tmp_path)).reference_source() == "hf:BF16+F32 (gptq)"
    exp = build(compose([*FAST, f"accuracy.kl_top_k={K}"]))
    metrics, tags = exp.engine.open(exp, "cpu", 1).references(load_tokenizer(exp.model))
    assert tags["reference.source"] == "random" and "reference_perplexity" in metrics


def test_kl_reference_must_be_exact_or_topk(compose):
    with pytest.raises(ConfigError, match="accuracy.kl_reference='full' is not allowed; choose one of: exact, topk"):
        build(compose([*FAST, "accuracy.kl_reference=full"]))


def test_the_memory_estimate_covers_what_the_accuracy_pass_holds():
    """Measured, not assumed: a scored pass with the KL at SmolLM2's vocabulary (49,152) and window (512), the model
    a stand-in whose logits cost nothing to make, lifts the RSS high-water mark by more than the logits part alone
    (the estimate's only accuracy part before 2026-12-06: the KL's float64 chunk temporaries were missing, and
    SmolLM2's default run peaked ~30% above its estimate) and by no more than the estimate's accuracy parts."""
    import gc
    import types

    import psutil

    from harness.config import AccuracyConfig
    from harness.measure import memory, peak_memory_mb, reset_peak_memory

    vocab, window = 49152, 512

    class Logits(torch.nn.Module):
        def forward(self, input_ids):
            return types.SimpleNamespace(logits=torch.randn(1, input_ids.shape[1], vocab))

    cfg = AccuracyConfig(context_length=window, stride=window, kl_reference="topk", max_tokens=0)
    ids = torch.randint(0, vocab, (4 * window,), generator=torch.Generator().manual_seed(0)).tolist()
    n = acc._n_scored(len(ids), cfg)
    top = torch.log_softmax(torch.randn(n, vocab), -1).topk(cfg.kl_top_k, -1)
    reference = {"top_lp": top.values, "top_idx": top.indices, "argmax": top.indices[:, 0], "meta": {"mode": "topk"}}
    del top
    gc.collect()
    if not reset_peak_memory("cpu"):
        pytest.fail("/proc/self/clear_refs is not writable: the high-water mark cannot be reset on this kernel")
    before = psutil.Process().memory_info().rss / 2**20
    out = acc.score(Logits(), ids, cfg, "cpu", reference=reference)
    held = peak_memory_mb("cpu") - before
    assert out["scored_tokens"] == n and out["kl_div_mean"] > 0
    parts = {k: v / 2**20 for k, v in memory.accuracy_parts(cfg, vocab, hidden=576).items()}
    assert parts["accuracy logits"] < held <= parts["accuracy logits"] + parts["accuracy KL"], (held, parts)


def test_corpus_tokens_reads_on_until_max_tokens_when_tokens_are_long(tmp_path):
    """The corpus was cut to 12 chars a token before tokenizing: text whose tokens pack more (SmolLM2 packs 64
    spaces or dashes into one) silently scored a fraction of `accuracy.max_tokens`."""
    corpus = tmp_path / "rules.txt"
    corpus.write_text("-" * 64 * 5000)

    def tok(text, add_special_tokens=False):  # 64 characters a token, as SmolLM2 on a line of dashes
        return {"input_ids": list(range(len(text) // 64))}

    assert len(acc.corpus_tokens(tok, str(corpus), 4096)) == 4096
    assert len(acc.corpus_tokens(tok, str(corpus), 0)) == 5000  # 0: the whole corpus
    assert len(acc.corpus_tokens(tok, str(corpus), 9000)) == 5000  # all there is
