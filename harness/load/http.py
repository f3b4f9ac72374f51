"""An OpenAI-compatible completions endpoint as a load target (`/v1/completions`, `stream: true`).

The same client serves the llama-server quantbench starts (harness/load/server.py) and any server given with
`load.url` (vLLM, TGI, SGLang, llama.cpp's server). Prompts go as token ids (exact lengths; every one of those
servers takes a list of ids as `prompt`); `ignore_eos` keeps each output at its drawn length (servers that
do not know the field ignore it, and the counted tokens say what came back). Output tokens come from the
final `usage` chunk (`stream_options.include_usage`), else from the run's tokenizer on the streamed text.
One thread and one connection per request in flight: the client's own work is small next to a decode step,
and `cancel` shuts that request's socket down, which ends its stream on the server too.

A request counts as finished only once its stream says `data: [DONE]`; a stream that stops before it (a
dropped connection, a crashed server) is an error, and so is one that carried no text at all.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from harness.load.driver import Request
from harness.load.stats import RequestRecord


class HttpTarget:
    """Stream completions from `base_url`; `server` (optional) is the process behind it, for `problem()`."""

    def __init__(self, base_url: str, *, tokenizer: Any, api_model: str = "", timeout_s: float = 300.0,
                 server: Any = None, name: str = "http", body: dict[str, Any] | None = None):
        parts = urlsplit(base_url.rstrip("/"))
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or (443 if self.https else 80)
        self.prefix = parts.path if parts.path.endswith("/v1") else parts.path + "/v1"
        self.tokenizer, self.api_model, self.timeout_s, self.server = tokenizer, api_model, timeout_s, server
        self.name = name
        self.body = dict(body or {})  # extra request fields, e.g. llama-server's cache_prompt
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()
        # each request in flight: its socket once connected (kept here: http.client lets go of a connection's
        # socket when the response says it will close, so `conn.sock` may be None while the stream runs)
        self.socks: dict[tuple[str, int], socket.socket | None] = {}
        self.cancelled: set[tuple[str, int]] = set()

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout_s)

    def submit(self, request: Request, record: RequestRecord, done: Callable[[], None]) -> None:
        with self.lock:
            self.socks[(request.tag, request.index)] = None
        t = threading.Thread(target=self._run, args=(request, record, done), daemon=True)
        self.threads.append(t)
        t.start()

    def _run(self, request: Request, record: RequestRecord, done: Callable[[], None]) -> None:
        body = {"prompt": request.prompt, "max_tokens": request.max_tokens, "stream": True, "temperature": 0.0,
                "ignore_eos": True, "stream_options": {"include_usage": True}, **self.body}
        if self.api_model:
            body["model"] = self.api_model
        text, usage, ended = [], None, False
        key = (request.tag, request.index)
        conn = None
        try:
            conn = self._connection()
            record.sent = record.now()  # when the bytes leave, the thread's start included in the lag
            conn.connect()
            with self.lock:  # a cancel that came while connecting found no socket to shut down
                if key in self.cancelled:
                    record.error = "cancelled"
                    return
                self.socks[key] = conn.sock
            conn.request("POST", f"{self.prefix}/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
            resp = conn.getresponse()
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {resp.read(300).decode(errors='replace').strip()}"
                return
            for raw in resp:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    ended = True
                    break
                chunk = json.loads(data)
                if not isinstance(chunk, dict):
                    record.error = f"stream chunk is not a JSON object: {data[:200]}"
                    return
                if chunk.get("error"):
                    record.error = f"server error: {str(chunk['error'])[:300]}"
                    return
                piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
                if piece:
                    record.chunks.append(record.now())
                    text.append(piece)
                usage = chunk.get("usage") or usage
            if not ended:
                record.error = "stream ended before [DONE]"
                return
            if not text:
                record.error = "empty response (no text before [DONE])"
                return
            if usage and usage.get("completion_tokens") is not None:
                record.output_tokens = int(usage["completion_tokens"])
            else:  # no usage from this server: count the streamed text with the run's tokenizer
                record.output_tokens = len(self.tokenizer("".join(text), add_special_tokens=False)["input_ids"])
            record.finished = True
        except Exception as exc:  # noqa: BLE001 - any failure is this request's error: a thread that died without
            # one left its request "unfinished" (as if it had timed out), and its rate an OK point with nothing answered
            record.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            if conn is not None:
                conn.close()
            with self.lock:
                self.socks.pop(key, None)
                self.cancelled.discard(key)
            done()

    def cancel(self, request: Request) -> None:
        """Give up on a request: shut its socket down (its thread ends, and the server sees the client go)."""
        key = (request.tag, request.index)
        with self.lock:
            if key not in self.socks:
                return
            self.cancelled.add(key)
            sock = self.socks[key]
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed by its own thread
                pass

    def problem(self) -> str:
        return self.server.problem() if self.server is not None else ""

    def close(self) -> None:
        for t in self.threads:
            t.join(timeout=1.0)
        self.threads.clear()
