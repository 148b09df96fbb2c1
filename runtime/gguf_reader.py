"""The bytes of a GGUF file, read defensively: typed metadata and a checked tensor layout.

The gguf package's reader trusts the file; these wrappers refuse what llama.cpp's own
loader refuses (reads past the end, tensors overlapping or misaligned), so a damaged or
hostile file is a one-line `CheckpointError`, never a hang, a huge allocation or
weights no one wrote. `runtime.gguf` maps what they read onto a checkpoint.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any

from runtime.config import MAX_INT_FIELD
from runtime.errors import CheckpointError
from runtime.files import shortened

import gguf
import numpy as np


class Metadata:
    """Typed access to a GGUF's key-value metadata, failing with the key's name."""

    def __init__(self, reader: gguf.GGUFReader, source: str):
        self._fields = reader.fields
        self._values: dict[str, Any] = {}  # decoded once: a vocabulary is ~10^5 strings
        self.source = source

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None:
            return default
        if key not in self._values:
            try:
                self._values[key] = field.contents()
            except (UnicodeDecodeError, ValueError, IndexError) as exc:
                reason = " ".join(str(exc).split())
                raise CheckpointError(
                    f"{self.source}: unreadable metadata '{key}' ({reason})"
                ) from None
        return self._values[key]

    def require(self, key: str, kind: type, most: int = MAX_INT_FIELD) -> Any:
        """The value of `key`, of type `kind`: positive, if a number, and at most `most`, if
        an integer (the config fields it fills hold 32 bits; named here by the GGUF key, where
        config.json's field name meant nothing to a GGUF's user)."""
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.source}: missing GGUF metadata '{key}'")
        if kind is float and isinstance(value, int):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise CheckpointError(
                f"{self.source}: GGUF metadata '{key}' should be {kind.__name__}, "
                f"got {shortened(repr(value))}"
            )
        if kind in (int, float) and isinstance(value, (int, float)) and not 0 < value < math.inf:
            raise CheckpointError(  # NaN too, which passed `value <= 0` and loaded
                f"{self.source}: GGUF metadata '{key}' must be a positive finite number, "
                f"got {value}"
            )
        if kind is int and isinstance(value, int) and value > most:
            raise CheckpointError(f"{self.source}: GGUF metadata '{key}' is {value}, more than {most}")
        return value

    def optional(self, key: str, kind: type, default: Any = None) -> Any:
        """`require(key, kind)` when the file has `key`, else `default`."""
        return self.require(key, kind) if key in self else default

    def array(self, key: str, item_kind: type, *, required: bool = True) -> Any:
        """`require(key, list)` (or `optional`), every item of type `item_kind` (a float
        may be stored as an int): merges stored as numbers failed deep in the tokenizer's
        construction, with an AttributeError."""
        items = self.require(key, list) if required else self.optional(key, list)
        kinds = (int, float) if item_kind is float else item_kind
        if items is not None and not all(
            isinstance(item, kinds) and not isinstance(item, bool) for item in items
        ):
            raise CheckpointError(
                f"{self.source}: GGUF metadata '{key}' should be an array of {item_kind.__name__}"
            )
        return items

    def string(self, key: str) -> str:
        return self.require(key, str)  # type: ignore[no-any-return]


# Array elements a file may hold in all: twice the most a real one does (a 262,144-token
# vocabulary's strings, scores and types, and its merges). The gguf package's reader
# keeps each string as a numpy view of its own, some 350 bytes apiece (770 MB at most).
MAX_ARRAY_ITEMS = 2**21

class BoundedReader(gguf.GGUFReader):
    """The gguf package's reader, refusing any read past the end of the file.

    Its own reader clamps such a read to the bytes left and carries on with what it got,
    so an array declaring more elements than the file holds was iterated to its declared
    count, reading nothing and appending empty parts: a 40-byte file declaring 2**62
    uint8s never finished, its memory growing.
    """

    # The fewest bytes one array element of each type takes: a string's length, an
    # array's item type and count.
    _MIN_ITEM_BYTES = {gguf.GGUFValueType.STRING: 8, gguf.GGUFValueType.ARRAY: 12}
    _array_items = 0  # declared so far, nested arrays' included

    @functools.cached_property
    def _bytes(self) -> np.ndarray:
        """The file as one plain array, which every value read is a view of: each view of
        the memmap carries the file's name and mode, and each view of a view made for one
        read kept that one alive too (for a vocabulary's strings, 1.6 KB apiece)."""
        return self.data.view(np.ndarray)

    def _get(
        self, offset: int, dtype: Any, count: int = 1, override_order: Any = None
    ) -> np.ndarray:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > len(self.data):
            raise ValueError(
                f"a value at byte {int(offset)} runs past the end of the file "
                f"({len(self.data)} bytes)"
            )
        data = self._bytes[int(offset) : end]
        order = self.byte_order if override_order is None else override_order
        return data.view(np.dtype(dtype).newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        if raw_type == gguf.GGUFValueType.ARRAY:
            item_type = gguf.GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            scalar = self.gguf_scalar_to_np.get(item_type)
            item_bytes = self._MIN_ITEM_BYTES.get(item_type, 1)
            if scalar is not None:
                item_bytes = np.dtype(scalar).itemsize
            if count * item_bytes > len(self.data) - (orig_offs + 12):
                raise ValueError(
                    f"an array at byte {orig_offs} declares {count} elements, more than "
                    "the rest of the file holds"
                )
            self._array_items += count
            if self._array_items > MAX_ARRAY_ITEMS:
                raise ValueError(
                    f"an array at byte {orig_offs} makes more than the {MAX_ARRAY_ITEMS} "
                    "array elements any real GGUF holds"
                )
            if scalar is not None or item_type == gguf.GGUFValueType.STRING:
                return self._array_parts(orig_offs, item_type, count)
        return super()._get_field_parts(orig_offs, raw_type)

    def _array_parts(self, orig_offs: int, item_type: gguf.GGUFValueType, count: int) -> Any:
        """An array of numbers or strings as the gguf package's reader returns it, in fewer
        parts: its numbers as one view (its own made one of each, 1.6 KB apiece with their
        byte counts and lengths), its strings one view each without their lengths.
        `ReaderField.contents()` reads the whole array the same (`Metadata` reads no
        single element of one, which would now find the numbers' first)."""
        parts = [self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)]
        offs = orig_offs + 12
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            parts.append(self._get(offs, scalar, count))
            offs += parts[-1].nbytes
        else:
            for _ in range(count):
                length = int(self._get(offs, np.uint64)[0])
                parts.append(self._get(offs + 8, np.uint8, length))
                offs += 8 + length
        types = [gguf.GGUFValueType.ARRAY, item_type]
        return offs - orig_offs, parts, list(range(2, len(parts))), types


def open_gguf(path: Path) -> gguf.GGUFReader:
    """The file's reader; an unreadable, truncated or unsupported file is a CheckpointError."""
    try:
        # A tensor offset that wraps round is refused by check_tensor_layout, not
        # warned about by numpy as the reader adds it up.
        with np.errstate(over="ignore"):
            return BoundedReader(path)
    except Exception as exc:  # the reader raises ValueError, KeyError, IndexError, ...
        reason = " ".join(str(exc).split()) or type(exc).__name__
        reason = re.sub(r"np\.\w+\((-?\d+)\)", r"\1", reason)  # numpy's repr of a number
        if "GGUFValueType" in reason:
            raise CheckpointError(f"{path}: unsupported GGUF metadata value type ({reason})") from None
        if "GGML" in reason:
            raise CheckpointError(f"{path}: unsupported GGUF tensor type ({reason})") from None
        raise CheckpointError(f"{path}: unreadable or truncated GGUF ({reason})") from None


def check_tensor_layout(reader: gguf.GGUFReader, path: Path) -> None:
    """Each tensor's data where llama.cpp's loader requires it: in the order of the
    tensor infos, each at the next multiple of the alignment after the one before, and
    within the file. The gguf package's reader takes any offset, so tensors sharing
    bytes, a misaligned one, or one whose uint64 offset wrapped round to point into the
    metadata loaded as weights no one wrote."""
    expected = 0  # from the start of the data section
    for tensor in reader.tensors:
        offset = int(tensor.field.parts[-1][0])
        if offset != expected:
            raise CheckpointError(
                f"{path}: tensor '{tensor.name}' has its data at offset {offset}, expected "
                f"{expected} (tensors overlapping, misaligned or out of order)"
            )
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        num_bytes = math.prod(int(n) for n in tensor.shape) // block_size * block_bytes
        if reader.data_offset + offset + num_bytes > len(reader.data):
            raise CheckpointError(
                f"{path}: truncated GGUF: tensor '{tensor.name}' runs past the end of the file"
            )
        alignment = int(reader.alignment)  # a numpy uint32 when the file states it: -x overflowed
        expected = offset + -(-num_bytes // alignment) * alignment
