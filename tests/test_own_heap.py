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


def test_a_side_by_side_ratio_whose_pairs_straddle_one_is_reported_undecided():
    """benchmarks/ab.py (own_heap.py, omp_pool.py): the ratio of two medians was printed as a finding whatever the
    spread ('kept / freed = 1.05x' from pairs 0.34x to 2.86x). It is the median of per-pair ratios, with their range,
    and 'undecided because noisy' when the pairs fall on both sides of 1."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("ab", ROOT / "benchmarks" / "ab.py")
    ab = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab)
    noisy = ab.ratio({"kept": [1.0, 2.0, 3.0], "freed": [2.9, 1.9, 1.05]}, "kept", "freed")
    assert noisy.startswith("kept / freed = 1.05x (pairs 0.34-2.86, n=3): undecided because noisy")
    clear = ab.ratio({"kept": [2.0, 2.2, 2.1], "freed": [1.0, 1.05, 1.1]}, "kept", "freed")
    assert clear == "kept / freed = 2.00x (pairs 1.91-2.10, n=3)"
    # rows measured one after the other (benchmarks/quantizers.py's vs fp32): the range of their p10-p90
    run = lambda mid, lo, hi: {"decode_tokens_per_s": mid, "decode_tokens_per_s_p10": lo,  # noqa: E731
                               "decode_tokens_per_s_p90": hi}
    assert ab.range_ratio(run(98, 90, 102), run(100, 95, 105)) == "0.98x (0.86-1.07, undecided because noisy)"
    assert ab.range_ratio(run(150, 140, 160), run(100, 95, 105)) == "1.50x (1.33-1.68)"
