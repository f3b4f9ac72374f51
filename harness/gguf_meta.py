"""One parse of a GGUF file per process, shared by everything that reads its metadata or tensor list.

gguf-py's `GGUFReader` parses every metadata field when it opens a file, and a model's vocabulary is one
such field: ~4 s for SmolLM2's 49k tokens on 2 cores. A llama.cpp run reads the file's header in five places
(format conversion, memory estimate, roofline shape, parameter count, linear bits), so opening it anew in each
cost ~20 s per run. `read(path)` opens it once per (path, size, modification time): a file replaced on disk is
read again. The reader memory-maps the file read-only; tensor data are only touched where they are read.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any


def read(path: str | Path) -> Any:
    """The `gguf.GGUFReader` of `path`, parsed once per process for the file as it is on disk now."""
    p = Path(path).resolve()
    st = p.stat()
    return _read(str(p), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read(path: str, size: int, mtime_ns: int) -> Any:
    from gguf import GGUFReader  # optional and heavy: only for a GGUF model

    return GGUFReader(path)
