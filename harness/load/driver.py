"""The open-loop client: seeded arrival times, sends on that clock, waits for the answers.

Arrivals (`load.arrival`) never depend on completions, so a slow target meets a growing queue, not a
politer client: `poisson` (exponential gaps), `gamma` (gaps with shape `load.burstiness`, vLLM's
burstiness: 1 is Poisson, < 1 burstier), `constant` (1/rate apart). `concurrency` is the exception, named as
such: `load.concurrency` requests in flight, the next one sent when one ends (guidellm's concurrent profile;
its synchronous profile is concurrency 1). A rate of `inf` sends everything at once (the maximum-throughput
run of a sweep).

Each request's scheduled and actual send time are recorded; the summary marks a rate whose p99 lag passes
`load.max_send_lag_ms` as not open-loop (on 2 cores the client shares the CPU with the model).

A target (http.py, inprocess.py) has `submit(request, record, done)`, which returns at once and calls
`done()` when the request ended (answered, failed or given up); `cancel(request)`, which stops a request the
client gave up on (its deadline passed) so it does not keep loading the target during the next rate;
`problem()`, a one-line reason once the target is dead; and `close()`.

A request unanswered `timeout_s` after its send expires, in either mode: its record is frozen as it stood
(unfinished), its slot is freed and the target is told to cancel it. The target's thread may still touch
the original record afterwards; the copy the driver returns no longer changes.
"""

from __future__ import annotations

import copy
import itertools
import math
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from harness.errors import QuantbenchError
from harness.load.stats import RequestRecord


@dataclass
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    tag: str = ""  # unique across a run's rates (the in-process manager keys requests by id)


class Target(Protocol):
    name: str

    def submit(self, request: Request, record: RequestRecord, done: Callable[[], None]) -> None: ...

    def cancel(self, request: Request) -> None: ...

    def problem(self) -> str: ...

    def close(self) -> None: ...


class TargetDied(QuantbenchError):
    """The target died during a rate; `records` holds what was answered before it did."""

    def __init__(self, message: str, records: list[RequestRecord], end: float):
        super().__init__(message)
        self.records, self.end = records, end


def schedule(arrival: str, rate: float, n: int, seed: int, burstiness: float = 1.0) -> list[float]:
    """Send times (seconds after the start, the first at 0) of n requests at `rate` requests/s, seeded."""
    if n <= 0:
        return []
    if math.isinf(rate) or arrival == "concurrency":
        return [0.0] * n
    if not rate > 0:
        raise ValueError(f"schedule: rate {rate!r} must be > 0")
    rng = random.Random(seed)  # lengths.draw draws from a stream of its own: a gap must not follow its prompt's length
    if arrival == "constant":
        gaps = [1.0 / rate] * (n - 1)
    elif arrival == "poisson":
        gaps = [rng.expovariate(rate) for _ in range(n - 1)]
    elif arrival == "gamma":  # mean 1/rate whatever the shape: scale = 1 / (rate * shape)
        gaps = [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n - 1)]
    else:
        raise ValueError(f"unknown arrival {arrival!r}")
    return [0.0, *itertools.accumulate(gaps)]


def drive(target: Target, requests: list[Request], times: list[float], timeout_s: float,
          concurrency: int = 0, poll_s: float = 0.05) -> tuple[list[RequestRecord], float]:
    """Send `requests` at `times` (or `concurrency` at a time when > 0) and wait for every answer.

    Returns the records and the end (seconds after the start: the last chunk, or the deadline of a request
    that never ended). Raises TargetDied (records kept) when the target dies; never drops a request: one
    unanswered by `timeout_s` after its send stays in the records as unfinished, and is cancelled."""
    t0 = time.perf_counter()
    records = [RequestRecord(index=r.index, prompt_tokens=len(r.prompt), max_tokens=r.max_tokens, scheduled=t,
                             origin=t0) for r, t in zip(requests, times, strict=True)]
    ended = [threading.Event() for _ in requests]
    expired: set[int] = set()
    lock = threading.Lock()  # done() runs on the target's threads, expiry on this one: a slot is freed once
    slots = threading.Semaphore(concurrency) if concurrency > 0 else None
    submitted = 0

    def finish(i: int) -> Callable[[], None]:
        def done() -> None:
            with lock:
                if ended[i].is_set() or i in expired:
                    return
                ended[i].set()
            if slots is not None:
                slots.release()
        return done

    def expire(i: int) -> None:
        with lock:
            if ended[i].is_set() or i in expired:
                return
            expired.add(i)
            records[i] = copy.deepcopy(records[i])  # frozen: the target's thread may still write to the original
        if slots is not None:
            slots.release()
        target.cancel(requests[i])

    def check() -> None:
        now = time.perf_counter() - t0
        for i in range(submitted):  # the sender's own loop: skip the ended ones without taking the lock
            if not ended[i].is_set() and i not in expired and now > records[i].sent + timeout_s:
                expire(i)
        if (why := target.problem()):
            for i in range(submitted):  # nothing more will come back: stop what is still in flight
                expire(i)
            raise TargetDied(why, records, time.perf_counter() - t0)

    for i, (req, rec) in enumerate(zip(requests, records, strict=True)):
        if slots is not None:  # closed loop: wait for a free slot; the slot's time is the schedule
            while not slots.acquire(timeout=poll_s):
                check()
            rec.scheduled = time.perf_counter() - t0
        else:
            while (wait := rec.scheduled - (time.perf_counter() - t0)) > 0:
                time.sleep(min(wait, poll_s))
                if wait > poll_s:
                    check()
        rec.sent = rec.now()  # the target may restamp it when the bytes leave (HTTP thread)
        submitted = i + 1
        target.submit(req, rec, finish(i))
    for i in range(len(records)):
        while not ended[i].wait(poll_s) and i not in expired:
            check()
    check()  # refused connections end requests at once, without a wait that would have noticed the death
    ends = [r.chunks[-1] for r in records if r.chunks]  # the last chunk, or the deadline of one never ended
    ends += [records[i].sent + timeout_s for i in expired]
    return records, max(ends, default=time.perf_counter() - t0)
