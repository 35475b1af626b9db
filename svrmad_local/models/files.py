"""A checkpoint's *.safetensors files as their headers describe them, checked against the bytes on
disk before any weight is read: a shard cut short by a partial download, a shard the index names
that is not there, a header whose shapes disagree with its offsets. Each is one line naming the
file and what is wrong with it (the safetensors library would raise its own error mid-load, or
`svrmad plan` would count bytes that are not there).

The format: 8 bytes little-endian header length, the JSON header (name -> dtype, shape,
data_offsets [begin, end) into the data that follows), then the data, which the offsets must cover
exactly, in order, from 0 to the end of the file.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

from svrmad_local.errors import UserError

INDEX = "model.safetensors.index.json"
# bytes per value of each safetensors dtype (sub-byte ones, F4/F6, are not size-checked per tensor)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8, "I64": 8, "U64": 8}
MAX_HEADER = 100_000_000  # the safetensors library's own limit on the JSON header


class CheckpointFileError(UserError, ValueError):
    """A weight file that is missing, cut short or not what its header says."""


def read_header(file: Path) -> dict[str, dict]:
    """The tensors of a safetensors file (name -> dtype, shape, data_offsets), checked against the
    file's size; `__metadata__` dropped."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= n <= MAX_HEADER:
                raise CheckpointFileError(f"{file} is not a safetensors file (header length {n}, file of {size} bytes)")
            if 8 + n > size:
                raise CheckpointFileError(f"{file} is cut short: {size} bytes, shorter than its own header "
                                          f"({8 + n} bytes); download it again")
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointFileError(f"{file} cannot be read: {exc.strerror or exc}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFileError(f"{file}: its safetensors header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{file}: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    _check_entries(file, header, size - 8 - n)
    return header


def _check_entries(file: Path, header: dict, data: int) -> None:
    """Every entry well-formed, sized as its shape says, and the offsets tiling the data exactly."""
    spans = []
    for name, t in header.items():
        ok = isinstance(t, dict) and {"dtype", "shape", "data_offsets"} <= t.keys()
        shape, offsets = (t.get("shape"), t.get("data_offsets")) if ok else (None, None)
        if not (ok and isinstance(t["dtype"], str) and _ints(shape) and _ints(offsets) and len(offsets) == 2
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointFileError(f"{file}: header entry {name!r} lacks a dtype, a shape or data_offsets "
                                      "[begin, end]")
        begin, end = offsets
        item = DTYPE_BYTES.get(t["dtype"])
        if item is not None and math.prod(shape) * item != end - begin:
            raise CheckpointFileError(
                f"{file}: tensor {name} is {t['dtype']} {shape} ({math.prod(shape) * item} bytes) but its "
                f"data_offsets span {end - begin} bytes; the header is inconsistent")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise CheckpointFileError(f"{file}: tensor {name} starts at byte {begin} of the data, expected {at} "
                                      "(tensors overlap or leave a gap); the header is inconsistent")
        at = end
    if at > data:
        raise CheckpointFileError(f"{file} is cut short by {at - data:,} bytes (a partial download?): its header "
                                  f"describes {at:,} bytes of data, the file holds {data:,}; download it again")
    if at < data:
        raise CheckpointFileError(f"{file} has {data - at:,} bytes more data than its header describes "
                                  f"({at:,}); the file is damaged")


def _ints(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def index_files(path: Path) -> list[str] | None:
    """The file names the folder's index maps its tensors to, sorted; None without an index. Each
    must be a plain name in the folder (an index pointing elsewhere is refused, never followed)."""
    index = Path(path) / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise CheckpointFileError(f"{index} is not a safetensors index (no weight_map of tensor -> file)") from None
    odd = next((n for n in names if not isinstance(n, str) or Path(n).name != n or n in ("", ".", "..")), None)
    if odd is not None:
        raise CheckpointFileError(f"{index} maps tensors to {json.dumps(odd)}, which is not a file name in the "
                                  "model's folder")
    return names


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: those its index names (each must be there), else every
    *.safetensors of the folder."""
    path = Path(path)
    names = index_files(path)
    if names is None:
        return sorted(path.glob("*.safetensors"))
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        raise CheckpointFileError(f"{path}: {len(missing)} of the {len(names)} weight files {INDEX} names "
                                  f"{'is' if len(missing) == 1 else 'are'} missing ({', '.join(missing[:3])}"
                                  f"{', ...' if len(missing) > 3 else ''}); download {'it' if len(missing) == 1 else 'them'}")
    return [path / n for n in names]


def check_files(path: Path) -> dict[Path, dict[str, dict]]:
    """Every weight file's header, checked (sizes, the index's files present); {} when none."""
    return {f: read_header(f) for f in weight_files(path)}
