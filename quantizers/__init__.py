"""Quantizers: how the weights are stored and multiplied.

A quantizer is a plain dataclass built by Hydra from conf/quantizer/<name>.yaml via `_target_`. The
base class (`quantizers.base.Quantizer`) knows no backend by name; it loads the model (passing the
quantizer's `from_pretrained_kwargs`, e.g. a transformers `quantization_config`), calls `apply` for
libraries that quantize an already-loaded model, then audits what was really stored and fails the run if
the quantizer silently did nothing.

To add one more quantizer:
1. Write `quantizers/<name>.py` with a subclass of `Quantizer`. Set `backend`, `library` (import name,
   for the version tag) and `max_bits_per_weight` (the audit's upper bound); override
   `from_pretrained_kwargs()` (transformers-integrated libraries) or `apply(model)` (libraries that
   quantize in place), and `preflight(device)` to fail before loading when the library is missing or
   the device is unsupported, naming the quantizer to use instead. Import the library inside methods,
   never at module top, so `import quantizers.<name>` works where it is not installed.
2. Add `conf/quantizer/<name>.yaml` with `_target_: quantizers.<name>.<Class>`.
3. Add the name to the parametrized quantizer tests (tests/test_quantizers.py).
"""
