"""The random model as a GGUF file llama.cpp runs: the same weights as engine=transformers, bit for bit.

`write_gguf(source, path)` streams the tensors of a `harness.models.random_model.RandomModel` into a BF16 GGUF with
the `gguf` package's writer (header and tensor infos first, then one tensor at a time, so an 8B model never
sits in memory whole); llama.cpp's own quantizer then makes Q8_0 / Q4_0 / F32 from it (harness/run/llama_cpp.py
`convert`, cached). What llama.cpp's convert_hf_to_gguf.py does for these architectures, repeated here:

- tensor names: token_embd, blk.N.{attn_norm, attn_q, attn_k, attn_v, attn_output, ffn_norm, ffn_gate,
  ffn_up, ffn_down}, output_norm, output (absent when the head is tied to the embedding);
  qwen2 adds the q/k/v biases (blk.N.attn_{q,k,v}.bias), a llama with `attention_bias` / `mlp_bias` the biases of
  every projection (blk.N.{attn_q, ..., ffn_down}.bias);
- llama only: the rows of q_proj and k_proj (and their biases) are permuted from HF's rotate-half RoPE layout to GGML's
  interleaved one (`permute`, with k over the key/value heads); qwen2 is stored as is (llama.cpp applies
  NEOX-style RoPE to it);
- llama3 RoPE scaling (`rope_scaling.rope_type = llama3`) becomes the `rope_freqs` tensor of per-frequency
  factors; 1-D tensors (norms, biases, rope_freqs) stay F32, matrices are BF16;
- a minimal tokenizer block llama.cpp accepts for the vocabulary size: a "llama" (SentencePiece) vocabulary
  of placeholder tokens `<tN>`, bos/eos/pad as control tokens. Nothing tokenizes text with it: the
  workload is token ids.

tests/test_random_model.py checks the claim on the tiny presets: llama.cpp's logits for a short id sequence
match transformers' within float32 rounding, for llama (permutation, rope_freqs, untied head) and qwen2
(biases, tied head).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import QuantbenchError
from harness.models.random_weights import first_id, values

# torch and gguf are imported where used: only engine=llama_cpp with model=random writes a GGUF (tests/test_layout.py,
# LAZY_OK).

LAYER_NAMES = {  # HF name inside a decoder layer -> GGUF name inside blk.N
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # Llama's `attention_bias` / `mlp_bias`: llama.cpp loads these as optional tensors of the llama architecture
    "mlp.gate_proj.bias": "ffn_gate.bias", "mlp.up_proj.bias": "ffn_up.bias", "mlp.down_proj.bias": "ffn_down.bias",
}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
FILE_TYPE_BF16 = 32  # llama_ftype LLAMA_FTYPE_MOSTLY_BF16


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    parts = hf_name.split(".")  # model.layers.N.<rest>
    if parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in LAYER_NAMES:
        raise KeyError(f"no GGUF name for tensor {hf_name}")
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}"


def permute(w: Any, n_head: int) -> Any:
    """HF q/k rows (rotate-half pairs) to GGML's interleaved pairs, as convert_hf_to_gguf's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def rope(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, scaling) from a config of either layout: `rope_theta` + `rope_scaling` (the presets), or
    transformers 5's `rope_parameters`, which holds both (a saved config.json, `model.config_path`). Reading only the
    first gave such a GGUF a base of 10000 and no llama3 factors, silently. A RoPE this export cannot write (yarn,
    linear, dynamic) is refused: llama.cpp would decode another model than transformers does."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = dict(cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else {}))
    kind = str(scaling.get("rope_type", scaling.get("type", "default"))).lower()
    if kind not in ("default", "llama3"):
        raise QuantbenchError(f"RoPE type {kind!r} has no GGUF export here (default and llama3 only), so llama.cpp "
                              "would not decode the model transformers does; use engine=transformers for this config")
    return theta, scaling


def llama3_rope_factors(cfg: dict) -> list[float] | None:
    """convert_hf_to_gguf's rope_freqs for rope_type llama3 (None for any other RoPE)."""
    base, scaling = rope(cfg)
    if str(scaling.get("rope_type", scaling.get("type", ""))).lower() != "llama3":
        return None
    dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    old = float(scaling.get("original_max_position_embeddings", 8192))
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / base ** (i / dim))
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return out


def _metadata(w: Any, arch: str, cfg: dict, name: str) -> None:
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    w.add_name(name)
    w.add_file_type(FILE_TYPE_BF16)
    w.add_quantization_version(2)
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(cfg["hidden_size"]))
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope(cfg)[0])
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))


def _tokenizer(w: Any, cfg: dict) -> None:
    from gguf import TokenType

    n = int(cfg["vocab_size"])
    special = {i for i in (first_id(cfg.get("bos_token_id")), first_id(cfg.get("eos_token_id")),
                           first_id(cfg.get("pad_token_id"))) if i is not None and i < n}
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(n)])
    w.add_token_scores([0.0] * n)
    w.add_token_types([TokenType.CONTROL if i in special else TokenType.NORMAL for i in range(n)])
    if (bos := first_id(cfg.get("bos_token_id"))) is not None:
        w.add_bos_token_id(bos)
    if (eos := first_id(cfg.get("eos_token_id"))) is not None:
        w.add_eos_token_id(eos)
    w.add_add_bos_token(False)  # the workload's ids are fed as they are, as to transformers


def plan(source: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name or "rope_freqs", GGUF name, shape) of every tensor, in file order."""
    meta = source.meta_model("bfloat16")
    out = [(hf, gguf_name(hf), tuple(p.shape)) for hf, p in meta.named_parameters()]
    if source.config.get("tie_word_embeddings"):
        out = [t for t in out if t[1] != "output.weight"]  # llama.cpp reuses token_embd
    factors = llama3_rope_factors(source.config)
    if factors is not None:
        out.insert(1, ("rope_freqs", "rope_freqs.weight", (len(factors),)))
    return out


def write_gguf(source: Any, path: Path) -> Path:
    """Write the source's weights as a BF16 GGUF at `path` (atomically: a temporary file, then a rename)."""
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter

    cfg = source.config
    arch = cfg["model_type"]
    tensors = plan(source)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.gguf")
    w = GGUFWriter(str(tmp), arch)
    try:
        _metadata(w, arch, cfg, source.name)
        _tokenizer(w, cfg)
        for _, name, shape in tensors:
            if len(shape) == 1:
                w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * shape[0])
            else:
                w.add_tensor_info(name, shape, np.dtype(np.int16), 2 * math.prod(shape),
                                  raw_dtype=GGMLQuantizationType.BF16)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        factors = llama3_rope_factors(cfg)
        for hf, name, shape in tensors:
            if hf == "rope_freqs":
                w.write_tensor_data(np.asarray(factors, dtype=np.float32))
                continue
            t = values(hf, shape, source.seed, source.std)
            if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
                # a q/k bias is added to the rows before RoPE, so it takes the rows' permutation
                t = permute(t, heads if ".attn_q." in name else kv_heads).contiguous()
            if len(shape) == 1:
                w.write_tensor_data(t.float().numpy())
            else:
                w.write_tensor_data(t.view(torch.int16).numpy())
            del t
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return path
