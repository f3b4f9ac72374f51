"""The values of the random model's weights (harness/models/random_model.py), shared with its GGUF writer.

One seeded block of BLOCK normal values (std = the config's initializer_range, rounded to bf16) is tiled
over every matrix and bias, starting at an offset derived from the tensor's name; norm weights are 1. A
tensor's values therefore depend only on (seed, name, shape), never on how the model is built, so the
transformers model and the GGUF (harness/models/gguf_export.py) hold the same weights, bit for bit. The values
are bf16 numbers: an fp32 load and an F32/BF16 GGUF of them are exact.

Kept apart from harness/models/random_model.py so that the GGUF writer, which random_model calls, can take the
values from below instead of importing its caller back.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

BLOCK = 1_048_573  # a prime: the rows of a matrix start at different shifts of the block
VALUES = 1  # version of the value recipe above: bump it when the values change (keys every cache)


def first_id(value: Any) -> int | None:
    """A token id from a config field that may hold one id or a list of them (the first counts)."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


@functools.lru_cache(maxsize=4)
def _block(seed: int, std: float) -> Any:
    """The seeded block, rounded to bf16 (the canonical values), kept in fp32 for exact casts."""
    import torch  # lazy: a heavy import that config validation of model=random never needs

    gen = torch.Generator().manual_seed(int(seed))
    return (torch.randn(BLOCK, generator=gen) * std).to(torch.bfloat16).float()


def _offset(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:12], 16) % BLOCK


def fill_(t: Any, name: str, seed: int, std: float) -> Any:
    """Write the values of tensor `name` into `t` in place (any dtype and device; see module docstring)."""
    if t.dim() == 1 and "norm" in name.rsplit(".", 2)[-2]:
        return t.fill_(1.0)
    import torch  # lazy: see _block

    off = _offset(name)
    rot = torch.cat([_block(seed, std)[off:], _block(seed, std)[:off]]).to(device=t.device, dtype=t.dtype)
    flat = t.view(-1)
    n, k = flat.numel(), flat.numel() // BLOCK
    if k:  # one broadcast copy: memory-bound, no Python loop over the tiles
        flat[: k * BLOCK].view(k, BLOCK).copy_(rot.expand(k, BLOCK))
    flat[k * BLOCK:].copy_(rot[: n - k * BLOCK])
    return t


def values(name: str, shape: tuple[int, ...], seed: int, std: float, dtype: Any = None) -> Any:
    """A new tensor holding the values of `name` (the GGUF writer and the safetensors copy use this)."""
    import torch  # lazy: see _block

    return fill_(torch.empty(shape, dtype=dtype or torch.bfloat16), name, seed, std)
