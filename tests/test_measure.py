"""harness.measure: the speed metrics' definitions, on synthetic Generations with hand-computed values, and the
decode loop's clock readings (TTFT, per-step ITL, decode wall clock) under a scripted clock."""

from __future__ import annotations

import math

import pytest

import strategies.decode as decode
from harness.measure import Generation, cv, percentile, summarize
from harness.models import TinyRandom, load_pretrained
from strategies.base import DecodeOptions


def gens() -> list[Generation]:
    """Three calls. Hand-computed below: the decode wall clock, not the sum of steps, sets decode tokens/s."""
    return [
        # 4 tokens: 1 from prefill, 3 from steps of 10, 20, 30 ms (sum 60 ms) in a decode phase of 80 ms
        Generation(sequences=[[1, 2, 3, 4]], prompt_tokens=10, ttft_s=0.1, step_s=[0.01, 0.02, 0.03],
                   decode_tokens=3, decode_wall_s=0.08),
        # 2 rows x 2 tokens, one step of 40 ms, no wall clock recorded (falls back to the step sum); its prompt took
        # 50 ms of its 200 ms TTFT (a scheduler that queues requests)
        Generation(sequences=[[5, 6], [7, 8]], prompt_tokens=8, ttft_s=0.2, step_s=[0.04], decode_tokens=2,
                   prefill_s=0.05),
        # max_new_tokens=1: the prefill token only, no decode step
        Generation(sequences=[[9]], prompt_tokens=6, ttft_s=0.3, step_s=[], decode_tokens=0, decode_wall_s=0.0),
    ]


def test_generation_properties():
    a, b, c = gens()
    assert a.decode_s == pytest.approx(0.08) and a.decode_s_steps == pytest.approx(0.06)
    assert a.decode_tokens_per_s == pytest.approx(3 / 0.08) and a.decode_step_tokens_per_s == pytest.approx(50.0)
    assert b.decode_s == pytest.approx(0.04) and b.decode_tokens_per_s == pytest.approx(50.0)  # fallback: steps
    assert a.prompt_s == 0.1 and b.prompt_s == 0.05  # prefill time where recorded, else TTFT
    assert b.prompt_tokens_per_s == pytest.approx(160.0)
    assert a.e2e_s == pytest.approx(0.18) and b.e2e_s == pytest.approx(0.24) and c.e2e_s == pytest.approx(0.3)
    assert (a.generated_tokens, b.generated_tokens, c.generated_tokens) == (4, 4, 1)
    assert math.isnan(c.decode_tokens_per_s) and math.isnan(c.decode_step_tokens_per_s)


def test_summarize_hand_computed():
    m = summarize(gens())
    # decode tokens/s per call: 37.5 (3 / 80 ms) and 50 (2 / 40 ms); the call without decode tokens is left out.
    # numpy's linear percentiles of two values: p50 = 43.75, p10 = 37.5 + 0.1 x 12.5, p90 = 37.5 + 0.9 x 12.5
    assert m["decode_tokens_per_s"] == pytest.approx(43.75)
    assert m["decode_tokens_per_s_p10"] == pytest.approx(38.75)
    assert m["decode_tokens_per_s_p90"] == pytest.approx(48.75)
    assert m["decode_tokens_per_s_cv"] == pytest.approx((12.5 / math.sqrt(2)) / 43.75)  # sd (ddof 1) / mean
    # over the step sums: 50 (3 / 60 ms) and 50 (2 / 40 ms)
    assert m["decode_step_tokens_per_s"] == pytest.approx(50.0)
    # TTFT over calls: 100, 200, 300 ms -> p50 200, p90 at rank 1.8: 200 + 0.8 x 100
    assert m["ttft_ms"] == pytest.approx(200.0) and m["ttft_ms_p90"] == pytest.approx(280.0)
    # ITL pooled over every step of every call: 10, 20, 30, 40 ms -> ranks 1.5, 2.7, 2.97
    assert m["itl_ms_p50"] == pytest.approx(25.0)
    assert m["itl_ms_p90"] == pytest.approx(37.0)
    assert m["itl_ms_p99"] == pytest.approx(39.7) and m["itl_samples"] == 4.0
    # e2e = TTFT + decode wall clock: 180, 240, 300 ms
    assert m["e2e_ms"] == pytest.approx(240.0)
    # prompt tokens over prefill time: 100, 160 (8 / 50 ms, not 8 / 200 ms TTFT = 40), 20 -> median 100
    assert m["prompt_tokens_per_s"] == pytest.approx(100.0)
    assert m["generated_tokens"] == 9.0 and m["timed_generations"] == 3.0


def test_wall_clock_lowers_tokens_per_s_when_host_work_sits_between_steps():
    steps = [0.01] * 10
    tight = Generation(sequences=[[0] * 11], prompt_tokens=1, ttft_s=0.01, step_s=steps, decode_tokens=10,
                       decode_wall_s=0.1)
    busy = Generation(sequences=[[0] * 11], prompt_tokens=1, ttft_s=0.01, step_s=steps, decode_tokens=10,
                      decode_wall_s=0.125)  # 2.5 ms of host work after each step
    t, b = summarize([tight]), summarize([busy])
    assert t["decode_tokens_per_s"] == pytest.approx(100.0) and b["decode_tokens_per_s"] == pytest.approx(80.0)
    assert t["decode_step_tokens_per_s"] == b["decode_step_tokens_per_s"] == pytest.approx(100.0)
    assert t["itl_ms_p50"] == b["itl_ms_p50"] == pytest.approx(10.0)  # ITL stays per step


def test_cv_is_the_noise_between_repetitions_not_the_spread_between_prompts():
    """A 3-token and a 923-token prompt decode at 800 and 100 tok/s on a quiet machine: the calls differ by
    8x, the repetitions not at all. The CV (and so the noisy-machine warning) must read 0, not 82%."""
    def call(rate: float) -> Generation:
        return Generation(sequences=[[0] * 9], prompt_tokens=3, ttft_s=0.01, step_s=[1 / rate] * 8,
                          decode_tokens=8, decode_wall_s=8 / rate)

    quiet = [call(r) for _ in range(5) for r in (800.0, 100.0)]  # repetition by repetition, batch by batch
    m = summarize(quiet, batches=2)
    assert m["decode_tokens_per_s_cv"] == pytest.approx(0.0, abs=1e-12)
    assert m["decode_tokens_per_s_p10"] == pytest.approx(100.0) and m["decode_tokens_per_s_p90"] == pytest.approx(800.0)
    # noise on the long prompt only: its CV (ddof 1) over 4 repetitions, RMS with the quiet short prompt's 0
    noisy = [call(r) for r in (800.0, 90.0, 800.0, 110.0, 800.0, 90.0, 800.0, 110.0)]
    sd = math.sqrt(4 * 10.0**2 / 3)
    assert summarize(noisy, batches=2)["decode_tokens_per_s_cv"] == pytest.approx(math.sqrt((sd / 100) ** 2 / 2))


def test_percentile_and_cv_edges():
    assert math.isnan(percentile([], 50))
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 25) == 2.0
    assert cv([5.0]) == 0.0 and cv([0.0, 0.0]) == 0.0
    assert cv([1.0, 3.0]) == pytest.approx(math.sqrt(2) / 2)
    m = summarize([])
    assert math.isnan(m["decode_tokens_per_s"]) and m["timed_generations"] == 0.0


class Clock:
    """A scripted `now()`: each reading is 1 s after the previous one."""

    def __init__(self) -> None:
        self.t = -1.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def test_decode_loop_clock_readings(monkeypatch):
    """Readings in strategies/decode.py: t0, first token, then (start, end) per step, then the decode phase's end.

    With a clock that ticks 1 s per reading: TTFT = 1, each step = 1, and the decode wall clock runs from the first
    token (1) to the end (2n + 2) for n steps: 2n + 1, so the n - 1 gaps between steps and the tail count too.
    """
    model = load_pretrained(TinyRandom(), "float32", "cpu")
    monkeypatch.setattr(decode, "now", Clock())
    gen = decode.greedy_generate(model, [[5, 6, 7]], DecodeOptions(max_new_tokens=6))
    n = 5  # decode steps after the prefill token
    assert gen.ttft_s == 1.0
    assert gen.step_s == [1.0] * n and gen.decode_tokens == n
    assert gen.decode_wall_s == 2 * n + 1
    assert gen.decode_tokens_per_s == pytest.approx(n / (2 * n + 1))
    assert gen.decode_step_tokens_per_s == pytest.approx(1.0)


def test_peak_reset_first_hands_freed_heap_back(monkeypatch):
    """The reset sets the high-water mark to the current RSS. What a cold cache freed just before (the GGUF
    conversion: SmolLM2 measured 1779 MB peak cold against 1355 MB warm) must leave the heap first."""
    import harness.measure as measure

    calls: list[str] = []
    monkeypatch.setattr(measure.gc, "collect", lambda: calls.append("collect") or 0)
    monkeypatch.setattr(measure, "trim_heap", lambda: calls.append("trim"))
    real_open = open

    def spy_open(path, *args, **kwargs):
        if str(path) == "/proc/self/clear_refs":
            calls.append("reset")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", spy_open)
    measure.reset_peak_memory("cpu")
    assert calls == ["collect", "trim", "reset"]
