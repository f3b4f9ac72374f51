"""One parse of a GGUF file per process, shared by everything that reads its metadata or tensor list.

gguf-py's `GGUFReader` parses every metadata field when it opens a file, and a model's vocabulary is one
such field: ~4 s for SmolLM2's 49k tokens on 2 cores. A llama.cpp run reads the file's header in five places
(format conversion, memory estimate, roofline shape, parameter count, linear bits), so opening it anew in each
cost ~20 s per run. `read(path)` opens it once per (path, size, modification time): a file replaced on disk is
read again. The reader memory-maps the file read-only; tensor data are only touched where they are read.
"""

from __future__ import annotations

import functools
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


def gguf_context_length(path: str | Path) -> int | None:
    """`<arch>.context_length` from a GGUF header, reading only the metadata (milliseconds; not the tensors)."""
    scalars = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
               12: "<d"}

    with open(path, "rb") as fh:
        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            return struct.unpack(fmt, fh.read(size))[0]

        def string() -> str:
            return fh.read(read("<Q")).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            if kind == 8:
                return string()
            if kind == 9:
                sub, count = read("<I"), read("<Q")
                if sub in scalars:  # skip fixed-size arrays in one seek
                    fh.seek(struct.calcsize(scalars[sub]) * count, os.SEEK_CUR)
                else:
                    for _ in range(count):
                        value(sub)
                return None
            return read(scalars[kind])

        if fh.read(4) != b"GGUF":
            return None
        version = read("<I")
        count_fmt = "<Q" if version >= 2 else "<I"
        read(count_fmt)  # tensors
        n_kv = read(count_fmt)
        arch, found = None, {}
        for _ in range(n_kv):
            key = string()
            val = value(read("<I"))
            if key == "general.architecture":
                arch = val
            elif key.endswith(".context_length"):
                found[key] = val
            if arch and f"{arch}.context_length" in found:
                return int(found[f"{arch}.context_length"])
    return None
