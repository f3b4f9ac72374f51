"""Serving load (harness/load/) when requests go wrong: a request that never ends (expired at its timeout in an
open or a closed loop, and cancelled at the target so it stops loading it), a stream cut before `[DONE]`, an
empty answer, a short one. Each fake server here is a thread on a loopback port; the in-process case runs
transformers' continuous batching on a 2-layer model (a second or two).
"""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.load.driver import Request, drive
from harness.load.http import HttpTarget
from harness.load.inprocess import InProcessTarget
from harness.load.stats import summarize


class Hang:
    """Accepts every request and never answers it (done() never called); remembers what it was told to cancel."""

    name = "hang"

    def __init__(self) -> None:
        self.cancelled: list[int] = []

    def submit(self, request, record, done) -> None:
        pass

    def cancel(self, request) -> None:
        self.cancelled.append(request.index)

    def problem(self) -> str:
        return ""

    def close(self) -> None:
        pass


def _drive_in_thread(target, n: int, timeout_s: float, concurrency: int, wait_s: float = 10.0):
    """drive() on its own thread, so a driver that never returns fails the test instead of hanging the suite."""
    out: dict = {}
    reqs = [Request(i, [1, 2, 3], 4) for i in range(n)]
    t = threading.Thread(target=lambda: out.update(r=drive(target, reqs, [0.0] * n, timeout_s, concurrency)),
                         daemon=True)
    t0 = time.perf_counter()
    t.start()
    t.join(wait_s)
    assert not t.is_alive(), f"drive(concurrency={concurrency}) ignored its {timeout_s} s timeout"
    return out["r"], time.perf_counter() - t0


@pytest.mark.parametrize("concurrency", [0, 1, 2])
def test_a_request_that_never_ends_expires_at_its_timeout_and_is_cancelled_in_open_and_closed_loops(concurrency):
    target = Hang()
    (records, end), took = _drive_in_thread(target, 3, 0.3, concurrency)
    # closed loop of 1: three requests one after the other, each given up at its deadline (~0.9 s in all)
    assert took < 3.0 and sorted(target.cancelled) == [0, 1, 2]
    m, _ = summarize(records, math.nan, {}, 50.0, end, closed=concurrency > 0)
    assert m["unfinished_requests"] == 3 and m["requests_sent"] == 3 and m["failed_requests"] == 0


class Streamer(BaseHTTPRequestHandler):
    """/v1/completions, streamed. The prompt's first id picks the behaviour: 0 an empty answer, 1 a stream cut
    before [DONE], 2 half the asked tokens then [DONE], 3 a slow full answer (0.2 s per token), 5 a chunk that is
    JSON but not an object, else a full answer at once. Counts the streams in flight and keeps each request's body."""

    protocol_version = "HTTP/1.0"
    active = 0
    bodies: list[dict] = []

    def log_message(self, *a) -> None:
        pass

    def _send(self, payload: str) -> None:
        self.wfile.write(f"data: {payload}\n\n".encode())
        self.wfile.flush()

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).bodies.append(body)
        kind, n = body["prompt"][0], body["max_tokens"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        type(self).active += 1
        try:
            if kind == 0:
                self._send(json.dumps({"choices": [{"text": ""}], "usage": {"completion_tokens": 0}}))
            elif kind == 5:
                self._send('["x"]')
            else:
                for _ in range(n // 2 if kind == 2 else n):
                    time.sleep(0.2 if kind == 3 else 0.0)
                    self._send(json.dumps({"choices": [{"text": "x"}]}))
                if kind == 1:
                    return  # the connection drops: no usage, no [DONE]
                self._send(json.dumps({"choices": [], "usage": {"completion_tokens": n // 2 if kind == 2 else n}}))
            self._send("[DONE]")
        except OSError:  # the client went away (a cancelled request)
            pass
        finally:
            type(self).active -= 1


@pytest.fixture()
def server():
    Streamer.active, Streamer.bodies = 0, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Streamer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}"
    srv.shutdown()


def test_every_request_is_ok_failed_or_unfinished_an_empty_or_cut_stream_fails_and_short_outputs_count(server):
    target = HttpTarget(server, tokenizer=None, timeout_s=5.0)
    reqs = [Request(i, [kind, 7], 8) for i, kind in enumerate([0, 1, 2, 4, 4])]
    records, end = drive(target, reqs, [0.0] * len(reqs), timeout_s=5.0)
    assert records[0].error == "empty response (no text before [DONE])" and not records[0].finished
    assert records[1].error == "stream ended before [DONE]" and not records[1].finished
    assert records[2].ok and records[2].output_tokens == 4 and records[3].ok
    m, _ = summarize(records, 1.0, {}, 50.0, end)
    assert m["requests_ok"] + m["failed_requests"] + m["unfinished_requests"] == m["requests_sent"] == 5
    assert (m["requests_ok"], m["failed_requests"], m["short_outputs"]) == (3, 2, 1)


def test_a_request_that_raises_anything_is_a_failed_request_with_its_error_not_an_unfinished_one(server):
    """A chunk that is JSON but no object (AttributeError), or a socket timeout the platform cannot hold (inf:
    OverflowError), killed the request's thread with no error: counted unfinished, as if it had timed out."""
    records, end = drive(HttpTarget(server, tokenizer=None, timeout_s=5.0), [Request(0, [5, 7], 4)], [0.0], 5.0)
    assert records[0].error == 'stream chunk is not a JSON object: ["x"]' and not records[0].finished
    target = HttpTarget(server, tokenizer=None, timeout_s=math.inf)
    (inf_records, inf_end), took = _drive_in_thread(target, 2, 5.0, 0)
    assert all(r.error.startswith("OverflowError: ") for r in inf_records) and took < 3.0
    for recs, e, n in ((records, end, 1), (inf_records, inf_end, 2)):
        m, _ = summarize(recs, 1.0, {}, 50.0, e)
        assert (m["failed_requests"], m["unfinished_requests"], m["requests_ok"]) == (n, 0, 0)


def test_extra_body_fields_reach_the_server(server):
    target = HttpTarget(server, tokenizer=None, timeout_s=5.0, body={"cache_prompt": False})
    drive(target, [Request(0, [4, 7], 2)], [0.0], timeout_s=5.0)
    assert Streamer.bodies[0]["cache_prompt"] is False and Streamer.bodies[0]["max_tokens"] == 2


def test_a_timed_out_http_request_is_cancelled_at_the_server_and_its_record_no_longer_changes(server):
    target = HttpTarget(server, tokenizer=None, timeout_s=5.0)
    records, end = drive(target, [Request(0, [3, 7], 20)], [0.0], timeout_s=0.7)  # 20 tokens take 4 s
    rec = records[0]
    seen = (len(rec.chunks), rec.finished, rec.error)
    assert 0 < seen[0] < 20 and not rec.finished and not rec.error and end == pytest.approx(rec.sent + 0.7)
    deadline = time.monotonic() + 3.0
    while Streamer.active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Streamer.active == 0, "the server still streams a request the client gave up on"
    time.sleep(0.3)
    assert (len(rec.chunks), rec.finished, rec.error) == seen  # summarised as unfinished, and stays so
    m, _ = summarize(records, 1.0, {}, 50.0, end)
    assert m["unfinished_requests"] == 1 and m["requests_ok"] == 0


def test_a_timed_out_in_process_request_leaves_the_running_batch():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    target = InProcessTarget(LlamaForCausalLM(cfg).eval(), parallel=2, max_len=4096)
    try:
        records, end = drive(target, [Request(0, [5, 6, 7], 4000, tag="r0")], [0.0], timeout_s=0.5)
        assert not records[0].finished and records[0].output_tokens < 4000  # ~50 s of decoding left
        scheduler = target.manager.batch_processor.scheduler
        deadline = time.monotonic() + 3.0
        while (scheduler.active_requests or scheduler.waiting_requests) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not scheduler.active_requests and not scheduler.waiting_requests and not target.pending
    finally:
        target.close()
