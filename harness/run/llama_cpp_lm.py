"""lm-eval's LM interface over llama.cpp: task accuracy for engine=llama_cpp (harness/analysis/task_accuracy.py).

Tokenization is the one lm-eval's HFLM uses, through the same HF tokenizer (TemplateLM._encode_pair encodes
context + continuation and splits off the context's tokens; no special tokens are added unless the tokenizer
adds them by default, as in HFLM), so both engines score the same token ids; llama.cpp supplies the
log-likelihoods (float32 logits, log-softmax in float64). The choices of a question share its context: the
context is decoded once and each choice on top of it, its KV positions removed before the next one.

lm-eval and llama-cpp-python are optional extras, so the class is built on first use (`lm_class()`, or
`from harness.run.llama_cpp_lm import LlamaCppLM`): importing this module needs neither.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from harness.errors import QuantbenchError


def __getattr__(name: str) -> Any:
    """`LlamaCppLM` on first access (PEP 562): the class needs the optional extras."""
    if name == "LlamaCppLM":
        return lm_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def lm_class() -> type:
    """The lm-eval LM class over llama.cpp (module docstring)."""
    import llama_cpp  # optional extra: loads the native llama.cpp library
    from lm_eval.api.model import TemplateLM  # optional extra: imports datasets, evaluate

    class LlamaCppLM(TemplateLM):
        """Log-likelihoods of (context, continuation) requests from a GGUF file through llama.cpp."""

        def __init__(self, gguf: Path, tokenizer: Any, threads: int, flash_attn: bool = False) -> None:
            super().__init__()
            self.gguf, self.tokenizer, self.threads = Path(gguf), tokenizer, threads
            self.flash_attn = flash_attn  # engine.flash_attn, as the engine's own context (harness/run/llama_cpp.py)

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        @property
        def prefix_token_id(self) -> int:  # HFLM's rule: BOS, else EOS (only for an empty context)
            bos = self.tokenizer.bos_token_id
            return bos if bos is not None else self.tokenizer.eos_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
            return self.tokenizer.encode(string, **extra)

        def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any
                                  ) -> list[tuple[float, bool]]:
            n_ctx = max(len(ctx) + len(cont) for _, ctx, cont in requests)
            llm = llama_cpp.Llama(model_path=str(self.gguf), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                  n_threads=self.threads, n_threads_batch=self.threads, logits_all=False,
                                  flash_attn=self.flash_attn, verbose=False)
            try:
                if n_ctx > llm._model.n_ctx_train():
                    raise QuantbenchError(f"a task request has {n_ctx} tokens, more than the model's context "
                                          f"({llm._model.n_ctx_train()}); lower accuracy.num_fewshot")
                groups: dict[tuple[int, ...], list[int]] = {}
                for i, (_, ctx, _) in enumerate(requests):
                    groups.setdefault(tuple(ctx), []).append(i)
                out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
                for ctx, members in groups.items():
                    llm._ctx.kv_cache_clear()
                    first = self._decode(llm, list(ctx), 0, last_only=True)  # predicts each choice's first token
                    for i in members:
                        cont = list(requests[i][2])
                        llm._ctx.kv_cache_seq_rm(0, len(ctx), -1)  # drop the previous choice
                        rows = [first] + ([self._decode(llm, cont[:-1], len(ctx))] if len(cont) > 1 else [])
                        logits = np.vstack(rows)
                        mx = logits.max(-1, keepdims=True)
                        logz = mx[:, 0] + np.log(np.exp(logits - mx).sum(-1))
                        ll = float((logits[np.arange(len(cont)), cont] - logz).sum())
                        out[i] = (ll, bool((logits.argmax(-1) == np.asarray(cont)).all()))
                return out
            finally:
                llm.close()

        @staticmethod
        def _decode(llm: Any, tokens: list[int], n_past: int, last_only: bool = False) -> np.ndarray:
            """Decode `tokens` at positions n_past..; the logits of every position (or of the last), float64."""
            llm._batch.set_batch(batch=tokens, n_past=n_past, logits_all=not last_only)
            llm._ctx.decode(llm._batch)
            n_vocab = llm.n_vocab()
            if last_only:
                row = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
                return np.ctypeslib.as_array(row, shape=(1, n_vocab)).astype(np.float64)  # a copy: the buffer is reused
            rows = llama_cpp.llama_get_logits(llm._ctx.ctx)
            return np.ctypeslib.as_array(rows, shape=(len(tokens), n_vocab)).astype(np.float64)

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            raise NotImplementedError("quantbench scores multiple-choice tasks only")

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            raise NotImplementedError("quantbench scores multiple-choice tasks only")

    return LlamaCppLM
