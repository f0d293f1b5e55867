"""The quantized weights of a GGUF file, cached after the first read (specdec/gguf.py)."""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np
import pytest
import torch

from specdec import gguf as gguf_module
from specdec.gguf import read_quantized, read_quantized_cached
from specdec.kernels.cpu_quant import QuantWeight


def write_gguf(path: pathlib.Path, seed: int) -> None:
    """A one-layer llama file with a Q4_1 output projection and a Q8_0 down projection."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    for name, qtype, shape in (
        ("blk.0.attn_output.weight", gguf.GGMLQuantizationType.Q4_1, (64, 64)),
        ("blk.0.ffn_down.weight", gguf.GGMLQuantizationType.Q8_0, (64, 96)),
    ):
        data = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_same(a: dict[str, QuantWeight], b: dict[str, QuantWeight]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        assert torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales), name
        assert (x.mins is None and y.mins is None) or torch.equal(x.mins, y.mins), name


@pytest.fixture
def no_reader(monkeypatch: pytest.MonkeyPatch):
    """Make any read of the GGUF file itself fail: what is returned then came from the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("the GGUF file was read again")

    return lambda: monkeypatch.setattr(gguf_module, "read_quantized", refuse)


def test_the_second_read_comes_from_the_cache_with_the_same_weights(tmp_path, no_reader) -> None:
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_gguf(path, seed=0)
    direct = read_quantized(path, 4, 2)
    assert {w.bits for w in direct.values()} == {4, 8}  # both kinds make the round trip
    assert_same(read_quantized_cached(path, 4, 2, cache), direct)
    assert len(list(cache.iterdir())) == 1  # the cache file, no staging file left behind
    no_reader()
    assert_same(read_quantized_cached(path, 4, 2, cache), direct)


def test_a_changed_file_is_read_again(tmp_path) -> None:
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_gguf(path, seed=0)
    first = read_quantized_cached(path, 4, 2, cache)
    write_gguf(path, seed=1)  # the same size: the modification time tells them apart
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    second = read_quantized_cached(path, 4, 2, cache)
    assert_same(second, read_quantized(path, 4, 2))
    assert not torch.equal(
        first["layers.0.mlp.down_proj"].codes, second["layers.0.mlp.down_proj"].codes
    )


def test_a_damaged_cache_is_read_around_and_replaced(tmp_path, caplog, no_reader) -> None:
    path, cache = tmp_path / "m.gguf", tmp_path / "cache"
    write_gguf(path, seed=0)
    direct = read_quantized_cached(path, 4, 2, cache)
    (cached,) = cache.iterdir()
    cached.write_bytes(cached.read_bytes()[:100])  # cut short, as by a full disk
    assert_same(read_quantized_cached(path, 4, 2, cache), direct)
    assert "unreadable cache" in caplog.text
    no_reader()
    assert_same(read_quantized_cached(path, 4, 2, cache), direct)  # the rewritten file


def test_an_unwritable_cache_still_gives_the_weights(tmp_path, caplog) -> None:
    path = tmp_path / "m.gguf"
    write_gguf(path, seed=0)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory should be")
    assert_same(read_quantized_cached(path, 4, 2, blocked / "cache"), read_quantized(path, 4, 2))
    assert "could not cache" in caplog.text
