"""An unquantized (F32) copy of a quantized GGUF file, for a llama.cpp server that should compute as the
in-process model does.

judgeloop's in-process SmolLM2 is the shipped Q4_1 GGUF dequantized to fp32 (``models/loading.py``). A
llama.cpp server on that same Q4_1 file has the same weights but other arithmetic: its quantized matmuls
quantize the activations to 8 bits. Served from the F32 copy written here, llama.cpp multiplies the very
fp32 weights the in-process model holds, in fp32.

    path = f32_gguf(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))  # written once under cache_dir()/gguf

The copy keeps every key/value of the source (architecture, hyperparameters, tokenizer, chat template)
except ``general.file_type``, which becomes ``ALL_F32``, and every tensor under its name and shape, in
llama.cpp's own layout (the source's: no transposing, no rope permutation), dequantized with
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from judgeloop.io import atomic_path, cache_dir
from judgeloop.logging import get_logger

logger = get_logger(__name__)

_LOCK = threading.Lock()


def _field_value(field: Any) -> tuple[Any, Any, Any]:
    """``(value, type, sub_type)`` of a reader field as ``GGUFWriter.add_key_value`` takes them; strings
    stay raw bytes, so a token that is not valid UTF-8 is copied as it is."""
    from gguf import GGUFValueType

    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        sub = field.types[-1]
        if len(field.types) != 2:
            raise NotImplementedError(f"GGUF key {field.name}: nested arrays are not supported")
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]) for i in field.data], kind, sub
        return field.contents(), kind, sub
    if kind == GGUFValueType.STRING:
        return bytes(field.parts[-1]), kind, None
    return field.contents(), kind, None


def write_f32_gguf(src: Path, dst: Path) -> None:
    """Write ``dst``: ``src`` with every tensor dequantized to F32 (same names, shapes and key/values,
    ``general.file_type`` = ``ALL_F32``).

    Tensors are dequantized and written one at a time (the source stays memory-mapped), so memory holds
    one F32 tensor, not the model.

    Raises:
        NotImplementedError: a tensor type ``gguf.quants`` cannot dequantize, or a nested-array key.
    """
    import numpy as np
    from gguf import GGUFReader, GGUFWriter, Keys, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(str(src))
    arch = reader.fields[Keys.General.ARCHITECTURE].contents()
    writer = GGUFWriter(str(dst), arch)  # it writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == Keys.General.ARCHITECTURE:
            continue  # the header's own counts and version, and the key written above
        if key == Keys.General.ALIGNMENT:
            writer.data_alignment = int(field.contents())
        if key == Keys.General.FILE_TYPE:
            writer.add_uint32(key, int(LlamaFileType.ALL_F32))
            continue
        writer.add_key_value(key, *_field_value(field))
    f32 = np.dtype(np.float32)
    for t in reader.tensors:
        # the reader's array is the tensor in numpy order (GGUF's shape reversed); the writer reverses it back
        shape = [int(n) for n in reversed(t.shape.tolist())]
        writer.add_tensor_info(t.name, shape, f32, int(t.n_elements) * f32.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type)  # (rows, row length), float32
        writer.write_tensor_data(np.ascontiguousarray(data, dtype=np.float32))
    writer.close()


def f32_gguf(src: Path) -> Path:
    """The F32 copy of GGUF file ``src`` under ``cache_dir()/gguf`` (``<src stem>.F32.gguf``), written
    the first time it is asked for (atomically: a killed write leaves no file).

    The cached copy is keyed by the source's file name and size: a source that changes under the same
    name and size is not noticed (delete the copy).
    """
    src = Path(src)
    target = cache_dir() / "gguf" / f"{src.stem}.{src.stat().st_size}.F32.gguf"
    if target.is_file():
        return target
    logger.info("dequantizing %s to an F32 GGUF in %s (once)", src.name, target)
    with _LOCK, atomic_path(target) as tmp:
        write_f32_gguf(src, tmp)
    return target


__all__ = ["f32_gguf", "write_f32_gguf"]
