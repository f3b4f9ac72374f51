"""Running one experiment: the measurement pipeline and what an engine plugs into it.

- harness/run/pipeline.py: `Pipeline`, the phase sequence written once (preflight, tokenizer and workload,
  references, load, prepare, warm-up, timed repetitions, summaries, accuracy, record). run.py (through
  harness/run/runner.py), every sweep cell and both sides of the gate (harness/gate/worker.py) run it.
- harness/run/hooks.py: `Session`, what an engine supplies for one run (load, prepare, one generate call,
  scoring, close), and `Outcome`, what a run measured. The engines (harness/run/engines.py: transformers,
  harness/run/llama_cpp.py: llama.cpp) implement `Session`.
- harness/run/result.py: `Result`, the record of one run, and the statuses a run ends with; free of torch, so
  what only reads or writes result JSONs (harness/records/, the report) starts fast.
"""
