"""Minimal GGUF v3 writer (numpy only) for the bundled models.

Writes metadata key/values and tensors in F32, F16 or Q8_0, or any type as
bytes made when the file is written (`add_tensor_bytes`, used by
`scripts/shape-gguf.py` for its random Q4_0/Q8_0 blocks). Only what the bundled
tier models (llama layout), the embedding model (bert layout) and the
benchmark shapes need; the format is documented in llama.cpp's `docs/gguf.md`.
"""

from __future__ import annotations

import mmap
import struct

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32

# Value types.
T_UINT8, T_INT8, T_UINT16, T_INT16, T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY, T_UINT64, T_INT64, T_FLOAT64 = range(13)

# ggml tensor types.
GGML_F32 = 0
GGML_F16 = 1
GGML_Q4_0 = 2
GGML_Q8_0 = 8

# llama_ftype values written to general.file_type.
FTYPE_F32 = 0
FTYPE_F16 = 1
FTYPE_Q4_0 = 2
FTYPE_Q8_0 = 7

QK8_0 = 32
QK4_0 = 32

# Bytes per block of 32 values: an f16 scale, then 32 int8 (Q8_0) or 32 nibbles (Q4_0).
BLOCK_BYTES = {GGML_Q8_0: 2 + QK8_0, GGML_Q4_0: 2 + QK4_0 // 2}


def tensor_nbytes(shape: tuple[int, ...], ggml_type: int) -> int:
    """Bytes of a tensor of `shape` (numpy order) stored as `ggml_type`."""
    n = 1
    for s in shape:
        n *= int(s)
    if ggml_type == GGML_F32:
        return 4 * n
    if ggml_type == GGML_F16:
        return 2 * n
    if ggml_type in BLOCK_BYTES:
        if shape[-1] % 32:
            raise ValueError(f"a quantized row needs a multiple of 32 values, got shape {shape}")
        return n // 32 * BLOCK_BYTES[ggml_type]
    raise ValueError(f"unsupported ggml type {ggml_type}")


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """Quantize rows of `x` (last dim a multiple of 32) to Q8_0 bytes.

    Same rounding as ggml's reference `quantize_row_q8_0_ref`: d = amax/127,
    q = roundf(x / d) (round half away from zero), d stored as f16.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    assert x.shape[-1] % QK8_0 == 0, x.shape
    blocks = x.reshape(-1, QK8_0)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    d = amax / 127.0
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(d > 0, 1.0 / d, 0.0)
    v = blocks * inv
    q = (np.sign(v) * np.floor(np.abs(v) + 0.5)).astype(np.int8)
    out = np.empty((blocks.shape[0], 2 + QK8_0), dtype=np.uint8)
    out[:, :2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(*x.shape[:-1], x.shape[-1] // QK8_0 * (2 + QK8_0))


def dequantize_q8_0(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Inverse of `quantize_q8_0`, for checks and q8-rounded references."""
    blocks = b.reshape(-1, 2 + QK8_0)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    return (q * d).reshape(shape)


class GGUFWriter:
    """Collects key/values and tensors, then writes one GGUF file."""

    def __init__(self) -> None:
        self.kv: list[tuple[str, int, object, int | None]] = []
        # (name, shape, ggml type, byte length, bytes or a function returning them)
        self.tensors: list[tuple[str, tuple[int, ...], int, int, object]] = []

    # --- metadata -----------------------------------------------------
    def add(self, key: str, vtype: int, value, elem_type: int | None = None) -> None:
        self.kv.append((key, vtype, value, elem_type))

    def add_str(self, key: str, value: str) -> None:
        self.add(key, T_STRING, value)

    def add_u32(self, key: str, value: int) -> None:
        self.add(key, T_UINT32, int(value))

    def add_i32(self, key: str, value: int) -> None:
        self.add(key, T_INT32, int(value))

    def add_f32(self, key: str, value: float) -> None:
        self.add(key, T_FLOAT32, float(value))

    def add_bool(self, key: str, value: bool) -> None:
        self.add(key, T_BOOL, bool(value))

    def add_array(self, key: str, elem_type: int, values) -> None:
        self.add(key, T_ARRAY, list(values), elem_type)

    # --- tensors ------------------------------------------------------
    def add_tensor(self, name: str, array: np.ndarray, ggml_type: int) -> None:
        """Add a tensor given in numpy (row-major) shape; ggml's ne is reversed."""
        shape = tuple(int(s) for s in array.shape)
        if ggml_type == GGML_F32:
            data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        elif ggml_type == GGML_F16:
            data = np.ascontiguousarray(array, dtype=np.float16).tobytes()
        elif ggml_type == GGML_Q8_0:
            data = quantize_q8_0(array).tobytes()
        else:
            raise ValueError(f"unsupported ggml type {ggml_type}")
        self.tensors.append((name, shape, ggml_type, len(data), data))

    def add_tensor_bytes(self, name: str, shape: tuple[int, ...], ggml_type: int, produce) -> None:
        """Add a tensor whose bytes `produce()` returns while the file is written.

        Only one tensor's bytes are in memory at a time, so files larger than memory
        can be written. `produce()` must return exactly `tensor_nbytes(shape, type)` bytes.
        """
        shape = tuple(int(s) for s in shape)
        self.tensors.append((name, shape, ggml_type, tensor_nbytes(shape, ggml_type), produce))

    # --- encoding -----------------------------------------------------
    @staticmethod
    def _str(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<Q", len(b)) + b

    @classmethod
    def _scalar(cls, vtype: int, v) -> bytes:
        fmt = {
            T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h",
            T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?",
            T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d",
        }
        if vtype == T_STRING:
            return cls._str(v)
        return struct.pack(fmt[vtype], v)

    def write(self, path: str) -> None:
        out = bytearray()
        out += GGUF_MAGIC + struct.pack("<IQQ", GGUF_VERSION, len(self.tensors), len(self.kv))
        for key, vtype, value, elem in self.kv:
            out += self._str(key) + struct.pack("<I", vtype)
            if vtype == T_ARRAY:
                out += struct.pack("<IQ", elem, len(value))
                for item in value:
                    out += self._scalar(elem, item)
            else:
                out += self._scalar(vtype, value)
        offset = 0
        for name, shape, gtype, nbytes, _ in self.tensors:
            ne = list(reversed(shape))
            out += self._str(name) + struct.pack("<I", len(ne))
            out += struct.pack(f"<{len(ne)}Q", *ne)
            out += struct.pack("<IQ", gtype, offset)
            offset += (nbytes + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        out += b"\0" * ((-len(out)) % ALIGNMENT)
        with open(path, "wb") as f:
            f.write(out)
            for name, _, _, nbytes, data in self.tensors:
                if callable(data):
                    data = data()
                if len(data) != nbytes:
                    raise ValueError(f"tensor {name}: {len(data)} bytes made, {nbytes} expected")
                f.write(data)
                f.write(b"\0" * ((-nbytes) % ALIGNMENT))


# ---------------------------------------------------------------------------
# Reading (for references computed from a committed GGUF)

_SCALAR_FMT = {
    T_UINT8: "<B", T_INT8: "<b", T_UINT16: "<H", T_INT16: "<h",
    T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?",
    T_UINT64: "<Q", T_INT64: "<q", T_FLOAT64: "<d",
}


def read_header(path: str) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]]]:
    """Metadata and tensor table of a GGUF file, without reading its tensor data.

    Returns (metadata, infos): infos holds (name, numpy shape, ggml type, absolute
    byte offset of the data) per tensor, in file order.
    """
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            meta, infos, _ = _parse_header(path, buf)
        finally:
            buf.close()
    return meta, infos


def read_gguf(path: str) -> tuple[dict, dict[str, tuple[np.ndarray, int]]]:
    """Read a GGUF file as written by `GGUFWriter`.

    Returns (metadata, tensors): metadata maps each key to its value (arrays as
    lists, FLOAT32 values as Python floats of the stored f32); tensors maps each
    name to (array dequantized to float32 in numpy row-major shape, ggml type).
    Supports F32, F16 and Q8_0 tensors.
    """
    with open(path, "rb") as f:
        buf = f.read()
    meta, infos, _ = _parse_header(path, buf)
    tensors: dict[str, tuple[np.ndarray, int]] = {}
    for name, shape, gtype, start in infos:
        n = int(np.prod(shape))
        if gtype == GGML_F32:
            arr = np.frombuffer(buf, dtype=np.float32, count=n, offset=start).reshape(shape).copy()
        elif gtype == GGML_F16:
            arr = np.frombuffer(buf, dtype=np.float16, count=n, offset=start).astype(np.float32).reshape(shape)
        elif gtype == GGML_Q8_0:
            nbytes = n // QK8_0 * (2 + QK8_0)
            raw = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
            arr = dequantize_q8_0(raw, shape)
        else:
            raise ValueError(f"{path}: tensor {name} has unsupported ggml type {gtype}")
        tensors[name] = (arr, gtype)
    return meta, tensors


def _parse_header(path: str, buf) -> tuple[dict, list[tuple[str, tuple[int, ...], int, int]], int]:
    """(metadata, tensor infos with absolute offsets, start of the data section)."""
    pos = 0

    def take(fmt: str):
        nonlocal pos
        vals = struct.unpack_from(fmt, buf, pos)
        pos += struct.calcsize(fmt)
        return vals if len(vals) > 1 else vals[0]

    def take_str() -> str:
        nonlocal pos
        n = take("<Q")
        s = buf[pos:pos + n].decode("utf-8")
        pos += n
        return s

    def take_value(vtype: int):
        if vtype == T_STRING:
            return take_str()
        if vtype == T_ARRAY:
            elem, n = take("<IQ")
            return [take_value(elem) for _ in range(n)]
        return take(_SCALAR_FMT[vtype])

    if buf[:4] != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version, n_tensors, n_kv = take("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: unsupported GGUF version {version}")
    meta: dict = {}
    for _ in range(n_kv):
        key = take_str()
        meta[key] = take_value(take("<I"))
    infos = []
    for _ in range(n_tensors):
        name = take_str()
        n_dims = take("<I")
        ne = [take("<Q") for _ in range(n_dims)]
        gtype, offset = take("<IQ")
        infos.append((name, tuple(reversed(ne)), gtype, offset))
    align = int(meta.get("general.alignment", ALIGNMENT))
    base = (pos + align - 1) // align * align
    return meta, [(n, shape, t, base + off) for n, shape, t, off in infos], base
