"""The F32 copy of a quantized GGUF (``judgeloop.models.gguf``), on a small GGUF written here with gguf-py."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

from judgeloop.models.gguf import f32_gguf, write_f32_gguf  # noqa: E402

Q = GGMLQuantizationType


def _quantized_gguf(path):
    """A llama-shaped GGUF: a Q8_0 embedding, a Q4_1 matrix, an F32 norm, an F16 vector, tokenizer keys."""
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 1)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_bool("tokenizer.ggml.add_bos_token", False)
    w.add_string("tokenizer.chat_template", "{{ messages }}")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "Ġc", "<|im_end|>"])
    w.add_key_value("tokenizer.ggml.token_type", [1, 1, 1, 3], GGUFValueType.ARRAY, GGUFValueType.INT32)
    w.add_uint32("general.file_type", 3)  # MOSTLY_Q4_1
    tensors = {
        "token_embd.weight": (rng.standard_normal((4, 64), dtype=np.float32), Q.Q8_0),  # (vocab, dim)
        "blk.0.attn_q.weight": (rng.standard_normal((32, 64), dtype=np.float32), Q.Q4_1),  # (out, in)
        "blk.0.attn_norm.weight": (rng.standard_normal(64, dtype=np.float32), Q.F32),
        "blk.0.bias": (rng.standard_normal(32, dtype=np.float32).astype(np.float16), Q.F16),
    }
    for name, (x, kind) in tensors.items():
        if kind in (Q.F32, Q.F16):
            w.add_tensor(name, x)
        else:
            w.add_tensor(name, quantize(x, kind), raw_dtype=kind)  # its shape in bytes per row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_every_tensor_is_its_dequantized_source_in_f32_under_the_same_name_and_shape(tmp_path):
    _quantized_gguf(tmp_path / "q.gguf")
    write_f32_gguf(tmp_path / "q.gguf", tmp_path / "f32.gguf")
    src, out = GGUFReader(str(tmp_path / "q.gguf")), GGUFReader(str(tmp_path / "f32.gguf"))
    assert [t.name for t in out.tensors] == [t.name for t in src.tensors]
    for s, o in zip(src.tensors, out.tensors):
        assert o.tensor_type == Q.F32 and o.shape.tolist() == s.shape.tolist()
        np.testing.assert_array_equal(o.data, dequantize(s.data, s.tensor_type).reshape(o.data.shape))
    # Q4_1 of random normals is lossy: the copy holds the quantized values, not the originals
    q = next(t for t in src.tensors if t.name == "blk.0.attn_q.weight")
    assert not np.array_equal(
        dequantize(q.data, q.tensor_type), _quantized_gguf(tmp_path / "again.gguf")[q.name][0]
    )


def test_every_key_is_kept_but_the_file_type(tmp_path):
    _quantized_gguf(tmp_path / "q.gguf")
    write_f32_gguf(tmp_path / "q.gguf", tmp_path / "f32.gguf")
    src, out = GGUFReader(str(tmp_path / "q.gguf")), GGUFReader(str(tmp_path / "f32.gguf"))
    assert list(out.fields) == list(src.fields)
    for key, field in src.fields.items():
        if key.startswith("GGUF.") and key != "GGUF.version":
            continue  # the header's counts
        got = out.fields[key]
        assert got.types == field.types, key
        if key == "general.file_type":
            assert (field.contents(), got.contents()) == (3, 0)  # MOSTLY_Q4_1 -> ALL_F32
        else:
            assert got.contents() == field.contents(), key


def test_the_copy_is_written_once_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGELOOP_CACHE", str(tmp_path / "cache"))
    _quantized_gguf(tmp_path / "q.gguf")
    first = f32_gguf(tmp_path / "q.gguf")
    assert first.parent == tmp_path / "cache" / "gguf" and first.name.endswith(".F32.gguf")
    mtime = first.stat().st_mtime_ns
    assert f32_gguf(tmp_path / "q.gguf") == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left
