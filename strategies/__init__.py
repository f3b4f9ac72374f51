"""Decode strategies: how tokens are generated from a loaded model.

A strategy is a plain class with typed keyword arguments (a dataclass), built by Hydra from
conf/strategy/<name>.yaml through `_target_`. It returns `harness.measure.Generation` objects: real
tokens only, per-step times, and its own counts (acceptance, ...) in `Generation.stats`.

To add one more strategy:
1. Write `strategies/<name>.py` with a subclass of `strategies.base.Strategy`; override `generate`
   (and `batches`, `setup`, `metrics`, `check_with` where needed). Reuse `strategies.decode` for the
   prefill/decode loop so timing and token counting stay identical across strategies; a loop of its
   own sets `Generation.decode_wall_s` (the decode phase's wall clock) next to its per-step times.
   Declare the capabilities (`stepwise`, `supports_context_depth`, `batches_rows`,
   `supports_llama_cpp`, `weight_dependent`: strategies/base.py); the harness asks them and never
   names a strategy.
2. Add `conf/strategy/<name>.yaml` with `_target_: strategies.<name>.<Class>` and its options.
3. Add the name to the parametrized strategy tests in tests/test_strategies.py.
"""
