"""The main thread hands its OpenMP workers back before transformers' batcher thread decodes (harness/measure/omp.py).

The speed it buys is measured in benchmarks/omp_pool.py, not here; these check the mechanism (the workers exit
and torch still computes) and that both batcher paths call it, on the waiting thread, before the batcher starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
from conftest import ROOT

from strategies.base import DecodeOptions

PROBE = """
import json, os, torch
from harness.measure.omp import free_omp_pool
tasks = lambda: set(os.listdir("/proc/self/task"))
torch.set_num_threads(2)
x = torch.arange(1 << 22, dtype=torch.float32)
total = float((x + 1).sum())          # a parallel region: the main thread's pool gets its worker
before = tasks()
freed = free_omp_pool()
after = tasks()
again = float((x + 1).sum())          # the next parallel op starts a fresh pool
print(json.dumps({"freed": freed, "gone": len(before - after), "new": len(after - before),
                  "regrown": len(tasks() - after), "same": again == total}))
"""


def test_the_callers_workers_exit_and_torch_still_computes():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"freed": True, "gone": 1, "new": 0, "regrown": 1, "same": True}


def test_continuous_batching_frees_the_pool_on_the_calling_thread_before_generate_batch(monkeypatch):
    import strategies.continuous_batch as cb

    events: list[tuple[str, int]] = []
    monkeypatch.setattr(cb, "free_omp_pool", lambda: events.append(("free", threading.get_ident())) or True)
    result = SimpleNamespace(request_id="req_0", generated_tokens=[1, 2], timestamps=[1.0, 2.0], created_time=0.5,
                             lifespan=(0.6, 2.0), error=None)

    def generate_batch(**kwargs):
        events.append(("generate", threading.get_ident()))
        return {"req_0": result}

    strategy = cb.ContinuousBatch(requests=1)
    for _ in range(2):
        model = SimpleNamespace(generate_batch=generate_batch,
                                register_forward_pre_hook=lambda fn: SimpleNamespace(remove=lambda: None))
        strategy.generate(model, [[3, 4]], DecodeOptions(max_new_tokens=2))
    me = threading.get_ident()
    assert events == [("free", me), ("generate", me)] * 2


def test_the_in_process_load_target_frees_the_pool_before_its_manager_starts(monkeypatch):
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    import harness.load.inprocess as inprocess

    events: list[str] = []
    monkeypatch.setattr(inprocess, "free_omp_pool", lambda: events.append("free") or True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).eval()
    real_init = model.init_continuous_batching

    def init(**kwargs):
        manager = real_init(**kwargs)
        real_start = manager.start
        manager.start = lambda: events.append("start") or real_start()
        return manager

    model.init_continuous_batching = init
    target = inprocess.InProcessTarget(model, parallel=2, max_len=64)
    try:
        assert events == ["free", "start"] and target.manager.is_running()
    finally:
        target.close()


def test_the_benchmark_runs():
    out = subprocess.run([sys.executable, "benchmarks/omp_pool.py", "--smoke"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "linear: kept / freed = " in out.stdout and "batch : kept / freed = " in out.stdout
