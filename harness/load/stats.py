"""What a load run measured: per-request times, per-rate summaries, goodput, capacity, the sweep's rates.

Per request (times from the streamed response, as `vllm bench serve` takes them): TTFT is the first chunk
that carries text; ITLs are the gaps between chunks (a chunk may carry several tokens); TPOT is the mean time
per output token after the first, (last chunk - first chunk) / (output tokens - 1); E2E is send to last chunk.
A request counts toward goodput when it finished and met every SLO that is set (`load.slo.*`); a rate's goodput
is its offered rate times the share of its requests that did (see `summarize`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from harness.measure import percentile

MS = 1000.0
QUANTILES = (50, 90, 99)
CLOSED = "n/a (closed loop)"  # load.open_loop of a closed-loop point, and of a run with no open-loop point


@dataclass
class RequestRecord:
    """One request as the client saw it; times are seconds after the rate's start (scheduled arrival 0)."""

    index: int
    prompt_tokens: int
    max_tokens: int
    scheduled: float
    sent: float = math.nan  # when the request was really sent (after the client's own delay)
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that carried text
    output_tokens: int = 0
    finished: bool = False
    error: str = ""
    origin: float = 0.0  # perf_counter() at the rate's start: `now()` is relative to it

    def now(self) -> float:
        return time.perf_counter() - self.origin

    @property
    def ok(self) -> bool:
        return self.finished and not self.error and bool(self.chunks)

    @property
    def failed(self) -> bool:
        """Ended in an error, or ended with no text at all (an empty answer is no answer)."""
        return bool(self.error) or (self.finished and not self.chunks)

    @property
    def ttft(self) -> float:
        return self.chunks[0] - self.sent if self.chunks else math.nan

    @property
    def e2e(self) -> float:
        return self.chunks[-1] - self.sent if self.chunks else math.nan

    @property
    def tpot(self) -> float:
        if len(self.chunks) < 2 or self.output_tokens < 2:
            return math.nan
        return (self.chunks[-1] - self.chunks[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:], strict=False)]

    @property
    def lag(self) -> float:
        return self.sent - self.scheduled


def meets(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Finished, and within every limit set ({"ttft_ms": .., "tpot_ms": .., "e2e_ms": ..}). A one-token output has
    no TPOT: that limit does not apply to it."""
    if not rec.ok:
        return False
    got = {"ttft_ms": rec.ttft * MS, "tpot_ms": rec.tpot * MS, "e2e_ms": rec.e2e * MS}
    if math.isnan(got["tpot_ms"]):
        got["tpot_ms"] = 0.0
    return all(got[k] <= limit for k, limit in slo.items())


def summarize(records: list[RequestRecord], offered: float, slo: dict[str, float], lag_limit_ms: float,
              end: float, closed: bool = False) -> tuple[dict[str, float], dict[str, str]]:
    """Metrics of one rate (names in harness/metrics.py, phase `serving`) and its tags.

    `end`: when the rate ended (seconds after its start): the last chunk, or the deadline when some request
    never finished. Throughputs divide by it; unfinished and failed requests stay in the counts, and every
    request is exactly one of ok, failed or unfinished. `closed`: a closed loop (a concurrency), whose schedule is
    stamped when a slot frees, so its send lag says nothing: not open-loop, not a lag."""
    ok = [r for r in records if r.ok]
    sent = [r for r in records if not math.isnan(r.sent)]
    duration = max(end, 1e-9)
    good = sum(meets(r, slo) for r in records)
    m: dict[str, float] = {
        "offered_rps": offered, "requests_sent": float(len(sent)), "requests_ok": float(len(ok)),
        "failed_requests": float(sum(r.failed for r in records)),
        "unfinished_requests": float(sum(not r.finished and not r.error for r in records)),
        "short_outputs": float(sum(r.output_tokens < r.max_tokens for r in ok)),  # a server that stopped early
        "request_throughput_rps": len(ok) / duration,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration,
        "load_duration_s": duration,
    }
    if math.isfinite(offered) and records:
        # the share of the rate's requests that met every SLO, per second of offered load: vLLM divides by the wall
        # time instead, whose drain (the last request's latency) biases a 32-request rate down by ~10% on its own
        m["goodput_share"] = good / len(records)
        m["goodput_rps"] = offered * m["goodput_share"]
        span = max(r.scheduled for r in records) - min(r.scheduled for r in records)
        # the rate the drawn gaps really offer: 32 seeded draws land within ~20% of the asked rate
        m["offered_actual_rps"] = (len(records) - 1) / span if span > 0 else math.nan
    else:  # synchronous, maximum throughput, a concurrency: nothing offered, so per second of wall time
        m["goodput_rps"] = good / duration
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", [r.tpot for r in ok if not math.isnan(r.tpot)]),
                         ("itl", [x for r in ok for x in r.itls]), ("e2e", [r.e2e for r in ok])):
        for q in QUANTILES:
            m[f"serve_{name}_ms_p{q}"] = percentile(values, q) * MS if values else math.nan
    if closed:
        m["send_lag_ms_p99"] = m["open_loop"] = math.nan
        return m, {"load.open_loop": CLOSED, "load.loop": "closed"}
    lags = [r.lag for r in sent]
    m["send_lag_ms_p99"] = percentile(lags, 99) * MS if lags else math.nan
    open_loop = not lags or m["send_lag_ms_p99"] <= lag_limit_ms
    m["open_loop"] = float(open_loop)
    tags = {"load.open_loop": str(open_loop).lower(), "load.loop": "open"}
    if not open_loop:
        tags["warning.open_loop"] = (f"p99 send lag {m['send_lag_ms_p99']:.1f} ms > load.max_send_lag_ms="
                                     f"{lag_limit_ms:g}: the client could not keep the schedule (not open-loop)")
    return m, tags


def capacity(points: list[tuple[float, float]], share: float) -> float:
    """The knee: the highest offered rate whose goodput is at least `share` of it, with every lower rate passing
    too; 0 when the lowest rate fails. A rate that passes above a failing one is noise in a short window (the
    arrivals happened to be kinder), not room the target has: `above_knee` lists those. points: (offered,
    goodput), open-loop rates only (the sweep's synchronous and maximum runs are not offered rates)."""
    cap = 0.0
    for rate, goodput in sorted(p for p in points if math.isfinite(p[0])):
        if goodput < share * rate:
            break
        cap = rate
    return cap


def above_knee(points: list[tuple[float, float]], share: float) -> list[float]:
    """Rates that pass although a lower rate failed (a non-monotone pass pattern), lowest first."""
    rates = sorted(p for p in points if math.isfinite(p[0]))
    first_fail = next((r for r, g in rates if g < share * r), math.inf)
    return [r for r, g in rates if r > first_fail and g >= share * r]


def sweep_rates(sync_rps: float, max_rps: float, n: int) -> list[float]:
    """The sweep's offered rates: n rates evenly spaced above the synchronous rate up to the maximum, the maximum
    included (guidellm stops short of it; offering it too brackets the capacity: when even the maximum keeps its
    goodput, the SLO does not bind and throughput is the limit). A maximum not above the synchronous rate: n rates
    up to it."""
    lo, hi = sync_rps, max(max_rps, sync_rps)
    if hi <= lo * 1.001:
        return [lo * (i + 1) / n for i in range(n)]
    return [lo + (hi - lo) * (i + 1) / n for i in range(n)]
