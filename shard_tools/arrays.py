"""Input arrays, opened without a copy and never through pickle: `.npy` memory-mapped with
`allow_pickle=False`; `.safetensors` memory-mapped by the safetensors library (BF16 included).
Pickle-based files (`.pt`, `.pth`, ...) are refused, saying how to save them instead."""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from pipeline.errors import InputError
from pipeline.format import BFLOAT16, COLUMN_DTYPES, storage_dtype

__all__ = ["file_stamp", "mapped", "open_array", "split_rows"]

_SAFETENSORS_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32", "I32": "int32",
    "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": BFLOAT16, "F32": "float32", "F64": "float64",
}
_EXTRA_HELP = "install the package's embeddings extra, or pip install 'safetensors>=0.4'"
_PICKLED = (".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".bin", ".joblib")
_PICKLE_HELP = ("loading it would run pickle, which can execute arbitrary code, so shard-pack never does. Save "
                "the tensor as .safetensors (safetensors.torch.save_file({'name': tensor}, 'x.safetensors'); keeps "
                "bfloat16) or .npy (numpy.save('x.npy', tensor.numpy()))")


def _safetensors(path: str, tensor: str | None, url: str) -> tuple[np.ndarray, str]:
    """The tensor, memory-mapped by the safetensors library (which checks the header: JSON, dtypes,
    offsets covering the data exactly) and viewed as numpy without a copy."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as exc:
        raise InputError(f"reading .safetensors needs the safetensors package: {_EXTRA_HELP}", url=url) from exc
    try:
        with safe_open(path, framework="pt") as f:
            names = sorted(f.keys())
            if tensor is None:
                if len(names) != 1:
                    raise InputError(f"holds tensors {names}: name one with \"tensor\" in the schema", url=url)
                (tensor,) = names
            if tensor not in names:
                raise InputError(f"no tensor {tensor!r}; the file holds {names}", url=url)
            stored = f.get_slice(tensor).get_dtype()
            if stored not in _SAFETENSORS_DTYPES:
                raise InputError(f"tensor {tensor!r}: dtype {stored} is not supported (dtypes: "
                                 f"{sorted(_SAFETENSORS_DTYPES)})", url=url)
            values = f.get_tensor(tensor)  # mapped: no byte is read until used
    except (SafetensorError, OSError) as exc:
        which = f" (reading tensor {tensor!r})" if tensor is not None else ""
        raise InputError(f"not a safetensors file{which}: {exc}"[:400], url=url) from exc
    dtype = _SAFETENSORS_DTYPES[stored]
    array = values.reshape(-1).view(torch.uint8).numpy().view(storage_dtype(dtype)).reshape(tuple(values.shape))
    array.flags.writeable = False  # as a read-only memory map
    return array, dtype


def _npy(path: str, url: str) -> tuple[np.ndarray, str]:
    with open(path, "rb") as f:
        if f.read(6) != b"\x93NUMPY":
            raise InputError(f"not a .npy file (no NPY magic); if it is a pickle, {_PICKLE_HELP}", url=url)
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        if "pickle" in str(exc) or "object" in str(exc).lower():
            raise InputError(f"holds Python objects, which only pickle can read: {_PICKLE_HELP}", url=url) from exc
        raise InputError(f"cannot read .npy: {exc}", url=url) from exc
    except OSError as exc:
        raise InputError(f"cannot read .npy: {exc}", url=url) from exc
    dtype = array.dtype
    name = dtype.name if dtype.kind in "biuf" and dtype.fields is None else ""
    if name not in COLUMN_DTYPES or name == BFLOAT16:
        raise InputError(f"dtype {dtype} is not supported (bool, ints, uints, float16/32/64; bfloat16 via "
                         ".safetensors)", url=url)
    return array, name


def open_array(path: str, tensor: str | None = None, url: str | None = None) -> tuple[np.ndarray, str]:
    """(array, dtype name) of an input file, memory-mapped, never through pickle. A bfloat16 array
    comes as its uint16 bit patterns. Raises InputError naming the file (`url`) and why."""
    url = url or path
    ext = os.path.splitext(path)[1].lower()
    if ext in _PICKLED:
        raise InputError(f"{ext} files are pickle archives: {_PICKLE_HELP}", url=url)
    if ext not in (".npy", ".safetensors"):
        raise InputError("unsupported file type: arrays are read from .npy or .safetensors files", url=url)
    if not os.path.isfile(path):
        raise InputError("no such file", url=url)
    if ext == ".npy":
        if tensor is not None:
            raise InputError(f"a .npy file holds one array: drop \"tensor\": {tensor!r} from the schema", url=url)
        return _npy(path, url)
    return _safetensors(path, tensor, url)


def file_stamp(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _mapped_at(path: str, tensor: str | None, stamp: tuple[int, int, int]) -> tuple[np.ndarray, str]:
    return open_array(path, tensor)


def mapped(path: str, tensor: str | None, stamp: tuple[int, int, int]) -> tuple[np.ndarray, str]:
    """The array as it was checked: a file replaced or rewritten since then is an error, not data."""
    if file_stamp(path) != stamp:
        raise InputError("changed since it was checked; run shard-pack again", url=path)
    return _mapped_at(path, tensor, stamp)


@functools.lru_cache(maxsize=16)
def split_rows(path: str, tensor: str | None, stamp: tuple[int, int, int]) -> np.ndarray:
    return np.sort(np.asarray(mapped(path, tensor, stamp)[0], dtype=np.int64))
