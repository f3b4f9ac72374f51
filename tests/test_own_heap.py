"""measure.own_heap: a run's garbage collections scan what the run made, not every imported module (a full
collection took 0.36 s with torch, transformers and MLflow imported; a tiny run went from 1.9 s to 0.4 s), and
what existed before the run is still collected after it."""

from __future__ import annotations

import gc
import weakref

from conftest import FAST


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_inside_only_new_garbage_is_collected_and_old_garbage_is_collected_after():
    from harness import measure

    old = Cycle()
    old_ref = weakref.ref(old)
    del old  # garbage in a cycle: only a collection frees it
    assert gc.get_freeze_count() == 0
    with measure.own_heap():
        assert gc.get_freeze_count() > 0
        new = Cycle()
        new_ref = weakref.ref(new)
        del new
        gc.collect()
        assert new_ref() is None  # the run's own garbage is freed between its phases, as before
        assert old_ref() is not None  # older objects are not scanned
        with measure.own_heap():  # nested: the inner one leaves the outer's frozen objects frozen
            pass
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None


def test_a_run_executes_inside_its_own_heap_and_leaves_nothing_frozen(compose, results_overrides, monkeypatch):
    from harness.run import runner

    seen = []
    real = runner.execute
    monkeypatch.setattr(runner, "execute", lambda exp: (seen.append(gc.get_freeze_count()), real(exp))[1])
    res = runner.run(compose(FAST + results_overrides + ["accuracy.enabled=false", "tracking.enabled=false"]))
    assert res.status == "OK", res.error
    assert seen and seen[0] > 10_000  # the imported modules' objects, at least
    assert gc.get_freeze_count() == 0


def test_the_gate_worker_serves_inside_its_own_heap(monkeypatch):
    from harness.gate import worker

    seen = []
    monkeypatch.setattr(worker, "serve", lambda *a, **k: seen.append(gc.get_freeze_count()))
    monkeypatch.setattr(worker.os, "dup2", lambda *a: None)  # keep pytest's own stdout
    monkeypatch.setattr(worker.sys, "stdout", worker.sys.stdout)
    worker.main()
    assert seen and seen[0] > 10_000 and gc.get_freeze_count() == 0
