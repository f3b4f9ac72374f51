"""transformers' continuous-batching manager as a load target, fed while it runs.

`model.init_continuous_batching()` starts the manager's generation thread (paged KV cache, requests joining
and leaving the running batch); each request is added at its arrival time with `streaming=True`, and a router
thread takes every streamed output from the manager's queue and stamps its new tokens on arrival, as a client
of a server would see them. EOS is off (`eos_token_id=-1`) so outputs keep their drawn lengths, as
`ignore_eos` does on the HTTP target. The cache is sized for `parallel` requests of the longest drawn length.
A request the client gave up on is cancelled in the manager (`cancel_request`): it leaves the running batch
instead of decoding on into the next rate.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from harness.errors import QuantbenchError
from harness.load.driver import Request
from harness.measure.omp import free_omp_pool
from strategies.continuous_batch import PAGED

PAGE = 32
logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # its INFO lines would flood the terminal


class InProcessTarget:
    """Requests into a running ContinuousBatchingManager (module docstring)."""

    name = "in-process"

    def __init__(self, model: Any, *, parallel: int, max_len: int, max_batch_tokens: int = 512):
        from transformers import ContinuousBatchingConfig, GenerationConfig  # heavy: only a load run needs it

        if not hasattr(model, "init_continuous_batching"):
            raise QuantbenchError(f"{type(model).__name__} has no continuous batching; the in-process load target "
                                  "needs a transformers model (or use engine=llama_cpp for llama-server)")
        pages = parallel * (-(-max_len // PAGE) + 1)
        cb = ContinuousBatchingConfig(page_size=PAGE, num_blocks=pages, max_batch_tokens=max_batch_tokens,
                                      max_requests_per_batch=parallel, auto_switch_to_flash=False)
        gen = GenerationConfig(do_sample=False, max_new_tokens=max_len, eos_token_id=-1, pad_token_id=0)
        self._attn = model.config._attn_implementation
        if self._attn != PAGED:
            model.set_attn_implementation(PAGED)
        self.model = model
        self.manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        free_omp_pool()  # the manager decodes on its own thread; this one only waits (harness/measure/omp.py)
        self.manager.start()
        self.pending: dict[str, tuple[Any, Callable[[], None]]] = {}
        self.lock = threading.Lock()
        self.running = True
        self.router = threading.Thread(target=self._route, daemon=True)
        self.router.start()

    def submit(self, request: Request, record: Any, done: Callable[[], None]) -> None:
        rid = f"{request.tag}-{request.index}"
        with self.lock:
            self.pending[rid] = (record, done)
        record.sent = record.now()
        self.manager.add_request(input_ids=request.prompt, request_id=rid, max_new_tokens=request.max_tokens,
                                 streaming=True, eos_token_id=-1)

    def cancel(self, request: Request) -> None:
        rid = f"{request.tag}-{request.index}"
        with self.lock:
            self.pending.pop(rid, None)  # whatever it still streams is dropped by the router
        self.manager.cancel_request(rid)

    def _route(self) -> None:
        while self.running:
            out = self.manager.get_result(timeout=0.02)
            if out is None:
                continue
            with self.lock:
                entry = self.pending.get(out.request_id)
            if entry is None:
                continue
            record, done = entry
            n = len(out.generated_tokens)
            if n > record.output_tokens:
                record.chunks.append(record.now())
                record.output_tokens = n
            if out.error:
                record.error = f"in-process batcher: {out.error}"[:300]
            if out.is_finished():
                record.finished = not out.error
                with self.lock:
                    self.pending.pop(out.request_id, None)
                done()

    def problem(self) -> str:
        fatal = self.manager.background_thread_status.fatal_error
        if fatal is not None:
            return f"the in-process batcher stopped: {type(fatal).__name__}: {str(fatal).splitlines()[0][:200]}"
        if not self.manager.is_running():
            return "the in-process batcher's generation thread is not running"
        return ""

    def close(self) -> None:
        self.running = False
        self.router.join(timeout=2)
        self.manager.stop(block=True, timeout=30)
        if self._attn not in (None, PAGED):
            self.model.set_attn_implementation(self._attn)
