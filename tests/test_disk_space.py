"""A full disk is refused in one line before a conversion or a weights write starts (CI once died of it)."""

from collections import namedtuple

import pytest

from harness import cache
from harness.errors import QuantbenchError

Usage = namedtuple("Usage", "total used free")


def test_require_free_refuses_in_one_line_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda _: Usage(10 << 30, 10 << 30, 100 << 20))
    with pytest.raises(QuantbenchError) as err:
        cache.require_free(tmp_path, 500 << 20, "converting x.gguf to F32")
    msg = str(err.value)
    assert "\n" not in msg and "500 MiB" in msg and "100 MiB" in msg and "QUANTBENCH_CACHE" in msg


def test_require_free_passes_when_the_disk_has_room(tmp_path, monkeypatch):
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda _: Usage(10 << 30, 0, 1 << 30))
    cache.require_free(tmp_path, 500 << 20, "converting x.gguf to F32")  # 1 GiB >= 550 MiB + 256 MiB
    with pytest.raises(QuantbenchError):
        cache.require_free(tmp_path, 800 << 20, "converting x.gguf to F32")  # 880 + 256 > 1024


def test_file_key_ignores_path_and_mtime_but_not_content(tmp_path):
    a, b = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf"
    for p in (a, b):
        p.parent.mkdir()
        p.write_bytes(bytes(range(256)) * 20000)
    import os
    os.utime(b, (1, 1))
    assert cache.file_key(a) == cache.file_key(b)
    b.write_bytes(bytes(range(256)) * 19999 + bytes(255) + b"\x01")
    assert cache.file_key(a) != cache.file_key(b)


@pytest.mark.skipif(not __import__("harness.run.llama_cpp", fromlist=["available"]).available(),
                    reason="llama-cpp-python extra not installed (scripts/setup.sh --all installs it; CI does)")
def test_llama_cpp_conversion_checks_the_disk_first_and_never_copies_the_same_format(tmp_path, monkeypatch):
    from harness.models.random_model import RandomModel
    from harness.run import llama_cpp as lc

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path))
    src = RandomModel(arch="tiny").make_gguf()  # BF16
    assert lc.convert(src, "BF16", 1) == src  # same format: the file itself, no copy
    called = []
    monkeypatch.setattr(lc.llama_cpp if hasattr(lc, "llama_cpp") else __import__("llama_cpp"),
                        "llama_model_quantize", lambda *a: called.append(a) or 1)
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda _: Usage(10 << 30, 10 << 30, 1 << 20))
    with pytest.raises(QuantbenchError, match="MiB are free"):
        lc.convert(src, "F32", 1)
    assert not called  # refused before llama.cpp started
