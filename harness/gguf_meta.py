"""One parse of a GGUF file per process, shared by everything that reads its metadata or tensor list.

gguf-py's `GGUFReader` parses every metadata field when it opens a file, and a model's vocabulary is one
such field: ~4 s for SmolLM2's 49k tokens on 2 cores. A llama.cpp run reads the file's header in five places
(format conversion, memory estimate, roofline shape, parameter count, linear bits), so opening it anew in each
cost ~20 s per run. `read(path)` opens it once per (path, size, modification time): a file replaced on disk is
read again. The reader memory-maps the file read-only; tensor data are only touched where they are read.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from pathlib import Path
from typing import Any

# what a damaged or truncated header raises while it is parsed (a length field of garbage: a huge read or seek)
HEADER_ERRORS = (OSError, struct.error, UnicodeDecodeError, OverflowError, MemoryError, ValueError, KeyError)


def read(path: str | Path) -> Any:
    """The `gguf.GGUFReader` of `path`, parsed once per process for the file as it is on disk now."""
    p = Path(path).resolve()
    st = p.stat()
    return _read(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader  # optional and heavy: only for a GGUF model

    return GGUFReader(path)


# F32, F16, Q4_0, Q4_1, Q8_0, BF16 (the formats quantbench converts to) where gguf-py is not installed
BLOCK_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 8: (32, 34), 30: (1, 2)}
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _unpack(fh: Any, fmt: str) -> Any:
    return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))[0]


def _string(fh: Any) -> str:
    n = _unpack(fh, "<Q")
    if n > os.fstat(fh.fileno()).st_size - fh.tell():  # a length past the end: garbage, never a huge read
        raise ValueError(f"a string of {n} bytes past the end of the file")
    return fh.read(n).decode("utf-8", "replace")


def _value(fh: Any, kind: int) -> Any:
    """A metadata value; arrays are skipped (None): the vocabulary is one, and nothing here needs it."""
    if kind == 8:
        return _string(fh)
    if kind == 9:
        sub, count = _unpack(fh, "<I"), _unpack(fh, "<Q")
        if sub in _SCALARS:  # skip fixed-size arrays in one seek
            fh.seek(struct.calcsize(_SCALARS[sub]) * count, os.SEEK_CUR)
        elif sub == 8:  # strings (the vocabulary): each length, then a seek past it (a seek past the end fails
            for _ in range(count):  # at the next read)
                fh.seek(_unpack(fh, "<Q"), os.SEEK_CUR)
        else:
            for _ in range(count):
                _value(fh, sub)
        return None
    return _unpack(fh, _SCALARS[kind])


def _counts(fh: Any) -> tuple[int, int] | None:
    """(tensors, metadata keys) after the magic and version, or None for a file that is not GGUF."""
    if fh.read(4) != b"GGUF":
        return None
    count_fmt = "<Q" if _unpack(fh, "<I") >= 2 else "<I"
    return _unpack(fh, count_fmt), _unpack(fh, count_fmt)


def gguf_context_length(path: str | Path) -> int | None:
    """`<arch>.context_length` from a GGUF header, reading only the metadata (milliseconds; not the tensors)."""
    with open(path, "rb") as fh:
        if (counts := _counts(fh)) is None:
            return None
        arch, found = None, {}
        for _ in range(counts[1]):
            key = _string(fh)
            val = _value(fh, _unpack(fh, "<I"))
            if key == "general.architecture":
                arch = val
            elif key.endswith(".context_length"):
                found[key] = val
            if arch and f"{arch}.context_length" in found:
                return int(found[f"{arch}.context_length"])
    return None


def data_end(path: str | Path) -> int | None:
    """`_data_end` of the file as it is on disk now (parsed once per process: preflight runs more than once)."""
    st = Path(path).stat()
    return _data_end(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _data_end(path: str, size: int, mtime_ns: int) -> int | None:
    """The size a whole file has: where its data section starts (after the tensor table, aligned to
    `general.alignment`) plus the furthest end of a tensor (its offset + its bytes, from the ggml type's block
    size). Read from the header and tensor table alone (milliseconds); None for a file that is not GGUF.
    A damaged header raises one of HEADER_ERRORS."""
    sizes = _block_sizes()
    with open(path, "rb") as fh:
        if (counts := _counts(fh)) is None:
            return None
        alignment = 32  # GGUF's default
        for _ in range(counts[1]):
            key = _string(fh)
            val = _value(fh, _unpack(fh, "<I"))
            if key == "general.alignment":
                alignment = int(val)
        end = 0
        for _ in range(counts[0]):
            _string(fh)
            dims = [_unpack(fh, "<Q") for _ in range(_unpack(fh, "<I"))]
            block, block_bytes = sizes.get(_unpack(fh, "<I"), (1, 0))  # a type unknown here: its offset alone
            end = max(end, _unpack(fh, "<Q") + math.prod(dims) // block * block_bytes)
        return -(-fh.tell() // alignment) * alignment + end


def _block_sizes() -> dict[int, tuple[int, int]]:
    """ggml type -> (elements per block, bytes per block): gguf-py's table, else the types quantbench writes."""
    try:
        from gguf import GGML_QUANT_SIZES
    except ImportError:
        return BLOCK_SIZES
    return {int(kind): (int(n), int(b)) for kind, (n, b) in GGML_QUANT_SIZES.items()}


def matrix_types(path: str | Path) -> list[str]:
    """The ggml types of the file's 2-D tensors (its weight matrices), most elements first: ["Q4_1", "Q8_0"] for
    SmolLM2's shipped GGUF (blocks Q4_1, token embedding Q8_0). Read from the header's tensor list alone."""
    elements: dict[int, int] = {}
    with open(path, "rb") as fh:
        if (counts := _counts(fh)) is None:
            return []
        for _ in range(counts[1]):
            _string(fh)
            _value(fh, _unpack(fh, "<I"))
        for _ in range(counts[0]):
            _string(fh)
            dims = [_unpack(fh, "<Q") for _ in range(_unpack(fh, "<I"))]
            kind = _unpack(fh, "<I")
            _unpack(fh, "<Q")  # the data offset
            if len(dims) == 2:
                elements[kind] = elements.get(kind, 0) + dims[0] * dims[1]
    try:
        from gguf import GGMLQuantizationType  # the type names (optional: installed with GGUF support)

        names = {t.value: t.name for t in GGMLQuantizationType}
    except ImportError:
        names = {}
    return [names.get(k, f"type{k}") for k in sorted(elements, key=lambda k: -elements[k])]
