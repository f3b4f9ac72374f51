"""The `load` section: open-loop serving load (harness/load/). Off unless `load.profile` is `rates` or `sweep`.

Every field is checked here, all at once, so a bad value (a negative rate, an unknown profile, an SLO of 0)
is refused in one line with exit 2 before a model loads or a server starts.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any
from urllib.parse import urlsplit

from harness.errors import ConfigError, one_of
from harness.load.lengths import spec_problem
from harness.schema import COMPILE_ONLY, Validated, no_password, positive, set_apart, shown

PROFILES = ("off", "rates", "sweep")  # off: an ordinary run; rates: load.rates; sweep: guidellm's sweep
ARRIVALS = ("poisson", "gamma", "constant", "concurrency")
MAX_TIMEOUT_S = 1e6  # load.request_timeout_s above this (~12 days) is a typo, and inf cannot be a socket timeout


@dataclass
class SloConfig(Validated):
    """Per-request limits a request must meet to count toward goodput; null = no limit on that measure."""

    ttft_ms: float | None = None  # time to first token
    tpot_ms: float | None = None  # mean time per output token after the first
    e2e_ms: float | None = None  # request latency, send to last token

    _section = "load.slo"

    def problems(self) -> list[str]:
        p: list[str] = []
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            value = getattr(self, name)
            if value is not None:
                positive(p, f"load.slo.{name}", value)
        return p

    def limits(self) -> dict[str, float]:
        """{measure: limit in ms} of the limits that are set."""
        return {k: float(v) for k in ("ttft_ms", "tpot_ms", "e2e_ms") if (v := getattr(self, k)) is not None}


@dataclass
class LoadConfig(Validated):
    """Open-loop request arrivals against an in-process batcher or an OpenAI-compatible server (docs/serving.md)."""

    profile: str = "off"  # off | rates (load.rates) | sweep (synchronous, max throughput, then rates between)
    rates: list[float] = field(default_factory=list)  # offered request rates, requests/s (profile=rates)
    sweep_rates: int = 4  # profile=sweep: rates evenly between the synchronous and the maximum rate
    arrival: str = "poisson"  # poisson | gamma (load.burstiness) | constant | concurrency (load.concurrency in flight)
    burstiness: float = 1.0  # gamma shape: 1 = Poisson, < 1 burstier, > 1 more regular (vllm bench serve's)
    concurrency: int = 4  # arrival=concurrency: requests kept in flight (closed loop by definition)
    requests: int = 32  # requests per rate
    lengths: str = "chat"  # chat (shipped) | fixed:P/O | uniform:P1-P2/O1-O2 | workload | a .jsonl of lengths
    seed: int = 0  # arrivals and lengths
    prompt_seed: int = 0  # the prompts' text only (same lengths): repeats against a server that caches prompts
    # (no effect with lengths=workload: those prompts are the run's own)
    slo: SloConfig = field(default_factory=SloConfig)
    goodput_share: float = 0.9  # capacity: the highest offered rate whose goodput is at least this share of it
    url: str = ""  # an OpenAI-compatible server already running (base URL); empty = quantbench starts its target
    api_model: str = ""  # the `model` field sent to load.url (vLLM, TGI and SGLang check it)
    parallel: int = 8  # requests decoded together: llama-server --parallel, in-process max_requests_per_batch
    max_send_lag_ms: float = 50.0  # p99 lag of actual after scheduled send above this: not open-loop (tagged)
    request_timeout_s: float = 300.0  # a request unanswered this long after its send is counted unfinished
    warmup_requests: int = 2  # untimed requests before the first rate

    _section = "load"

    def __post_init__(self) -> None:
        self._slo_problems: list[str] = []
        if isinstance(self.slo, dict):
            try:
                self.slo = SloConfig(**self.slo)
            except ConfigError as exc:  # reported with the other fields' problems, all at once
                self._slo_problems = exc.problems
        super().__post_init__()

    @property
    def enabled(self) -> bool:
        return self.profile != "off"

    def problems(self) -> list[str]:
        p = list(self._slo_problems) + [e for e in (one_of("load.profile", self.profile, PROFILES),
                         one_of("load.arrival", self.arrival, ARRIVALS)) if e]
        rates = list(self.rates or [])
        for r in rates:
            if not isinstance(r, (int, float)) or isinstance(r, bool) or not r > 0 or r == float("inf"):
                p.append(f"load.rates={rates} must hold finite request rates > 0 (requests/s)")
                break
        if self.profile == "sweep" and self.arrival == "concurrency":  # it would run one concurrency, no sweep
            p.append("load.profile=sweep offers rates, and load.arrival=concurrency offers none (one closed loop at "
                     "load.concurrency): use load.profile=rates with it, or another load.arrival")
        if self.profile == "rates" and not rates and self.arrival != "concurrency":  # a concurrency needs no rate
            p.append("load.profile=rates needs load.rates=[r1,r2,...] (requests/s), or use load.profile=sweep")
        for name in ("sweep_rates", "concurrency", "requests", "parallel"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                p.append(f"load.{name}={v!r} must be an integer >= 1")
        positive(p, "load.burstiness", self.burstiness)
        positive(p, "load.max_send_lag_ms", self.max_send_lag_ms)
        positive(p, "load.request_timeout_s", self.request_timeout_s)
        t = self.request_timeout_s  # a socket's timeout must fit the platform's clock (NaN and inf: positive())
        if isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > MAX_TIMEOUT_S:
            p.append(f"load.request_timeout_s={t!r} must be a finite number of seconds <= {MAX_TIMEOUT_S:.0f} (a "
                     "request unanswered that long after its send counts as unfinished)")
        positive(p, "load.warmup_requests", self.warmup_requests, allow_zero=True)
        positive(p, "load.prompt_seed", self.prompt_seed, allow_zero=True)
        if not isinstance(self.goodput_share, (int, float)) or not 0 < self.goodput_share <= 1:
            p.append(f"load.goodput_share={self.goodput_share!r} must be in (0, 1]")
        if self.url and not str(self.url).startswith(("http://", "https://")):
            p.append(f"load.url={self.url!r} must be an http:// or https:// base URL, e.g. http://127.0.0.1:8080")
        before = len(p)
        no_password(p, "load.url", self.url or "", "point it at an endpoint that needs no login (load runs send no "
                                                    "credentials; a local proxy can add them)")
        if len(p) == before and (part := url_extra(str(self.url or ""))):  # the line names the part, not its value
            p.append(f"load.url holds {part}, which requests do not send (only scheme, host, port and path) and MLflow "
                     "would record as a param; give the base URL alone, e.g. http://127.0.0.1:8080/v1, at an endpoint "
                     "that needs no login (a local proxy can add credentials)")
        if (err := spec_problem(str(self.lengths))):
            p.append(err)
        return p

    def unread(self) -> dict[str, str]:
        """Settings this profile and arrival do not read, set away from their defaults: setting -> one line naming
        it to drop (they were accepted, recorded as params, and ignored). Refused by harness/cli.py's precheck, which
        judges a sweep as a whole: load.burstiness in a sweep over load.arrival=poisson,gamma is read by a cell."""
        if not self.enabled:
            return {}
        default = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        p: dict[str, str] = {}
        rates = list(self.rates or [])
        if rates and self.arrival == "concurrency":
            p["rates"] = (f"load.arrival=concurrency keeps load.concurrency={self.concurrency} requests in flight "
                          f"and offers no rate: load.rates={rates} would not be read; drop load.rates")
        elif rates and self.profile == "sweep":
            p["rates"] = (f"load.profile=sweep picks its own rates: load.rates={rates} would not be read; drop "
                          "load.rates, or use load.profile=rates")
        if self.profile == "rates" and self.sweep_rates != default["sweep_rates"]:
            p["sweep_rates"] = f"load.sweep_rates={self.sweep_rates!r} is read by load.profile=sweep only; drop it"
        if self.burstiness != default["burstiness"] and self.arrival != "gamma":
            p["burstiness"] = (f"load.burstiness={self.burstiness!r} is read by load.arrival=gamma only (this run: "
                               f"load.arrival={self.arrival}); drop it, or set load.arrival=gamma")
        if self.concurrency != default["concurrency"] and self.arrival != "concurrency":
            p["concurrency"] = (f"load.concurrency={self.concurrency!r} is read by load.arrival=concurrency only "
                                f"(this run: load.arrival={self.arrival}); drop it, or set load.arrival=concurrency")
        return p


def url_extra(url: str) -> str:
    """The part of load.url that HttpTarget would drop (user info, a query, a fragment), named; '' for none."""
    try:
        parts = urlsplit(url)
    except ValueError:  # not a URI: no_password says so
        return ""
    return ("user info (the part before @)" if "@" in parts.netloc else "a query string (?...)" if parts.query
            else "a fragment (#...)" if parts.fragment else "")


# measure settings a load run does not read, and the load option that governs there instead
NOT_READ = {"repetitions": "load.requests", "warmup": "load.warmup_requests",
            "context_depth": "load.lengths (no depth context is sent)",
            "stop_at_eos": "load.lengths (outputs keep their drawn lengths)"}
# decode settings a load target does not take: it decodes as it does (in process: eager, paged KV cache)
# (measure.gemv=aten turns oneDNN off around batch-1 steps of quantbench's own loop, which a load target never runs)
NOT_TAKEN = {"compile": ("auto", False), "cache": ("auto", "dynamic"), "path": ("best", "eager"),
             "gemv": ("auto", "onednn", "rows8"), **COMPILE_ONLY}


def conflicts(load: LoadConfig | None, parts: dict, measure: Any) -> list[str]:
    """Settings a load run would accept and record but not use: one line each, naming what governs instead.

    A load run offers `load.requests` requests per rate to the target's own scheduler (transformers' continuous
    batching in process, llama-server's slots, or the server at `load.url`), `load.parallel` decoded together:
    the strategy, the timed repetitions and the compiled decode path of an ordinary run do not apply. With
    `load.url` the server's weights are its own: a quantbench quantizer would only label its numbers."""
    if load is None or not load.enabled or measure is None:
        return []
    p: list[str] = []
    on = f"load.profile={load.profile}"
    strategy = parts.get("strategy")
    if strategy is not None and (strategy.batches_rows or not strategy.stepwise):
        p.append(f"{on} decodes with the target's own continuous batching (load.parallel={load.parallel} requests "
                 f"together): strategy {strategy.name} does nothing there; drop the strategy and set load.parallel")
    defaults = {f.name: f.default for f in fields(type(measure)) if f.default is not MISSING}
    for name, governs in NOT_READ.items():
        if (v := getattr(measure, name, None)) != defaults.get(name, v):
            p.append(f"{on} does not read measure.{name}={shown(v)}: {governs} governs a load run; drop it")
    if odd := set_apart(measure, NOT_TAKEN):
        p.append(f"{on}: the target decodes as it does (in process: eager, paged KV cache) and {', '.join(odd)} "
                 "would not apply; drop it")
    quantizer = parts.get("quantizer")
    if load.url and quantizer is not None and quantizer.name != "none":
        p.append(f"load.url measures the server already running there, on its own weights: quantizer={quantizer.name} "
                 "would only label its numbers; drop it (the run is tagged quantizer.name=external)")
    return p
