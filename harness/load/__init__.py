"""Serving load: open-loop request arrivals against a target, goodput under an SLO, capacity per format.

    config.py    the `load` section (LoadConfig, SloConfig): every value checked at config time
    lengths.py   request lengths (chat, fixed, uniform, a JSONL, the run's workload) and prompts of those lengths
    driver.py    seeded arrival schedules and the open-loop client; the target interface
    http.py      an OpenAI-compatible /v1/completions endpoint, streamed (llama-server, or any load.url)
    server.py    llama.cpp's llama-server: started on a free loopback port, never outliving its run
    inprocess.py transformers' continuous-batching manager, fed while it runs
    stats.py     per-request TTFT / ITL / TPOT / E2E, per-rate summaries, goodput, capacity, the sweep's rates
    run.py       one load run: the target, the rates (nested MLflow runs), the capacity
    report.py    the sweep report's capacity table and latency-throughput figure

A new target is a class with `submit(request, record, done)`, `cancel(request)`, `problem()` and `close()`
(driver.py), chosen in run.py's `LoadRun.open`.
"""
