"""``.npy`` parsing for untrusted arrays: the header is read and checked (version, dtype,
shape, and that the data is exactly the bytes that follow) before any data is touched, then the
data is read into one buffer of that size, in native byte order.

Used for a wire ``Array``'s bytes (:func:`wire_layout`, :func:`from_buffer`) and for the arrays
of a cached upload's npz (:func:`read_npy`).
"""

from __future__ import annotations

import dataclasses
import io
import math
import zipfile
from dataclasses import dataclass
from typing import IO

import numpy as np
from flwr.app import Array

from fedfusion.core.state import WIRE_DTYPES
from fedfusion.reasons import brief, clip

#: zip compressions np.savez / np.savez_compressed write; the others (bzip2, lzma) inflate
#: a whole read at once, unbounded
ZIP_COMPRESSIONS = (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)
#: what reading an untrusted ``.npz`` (a zip of ``.npy``) can raise besides the readers' own
#: checks; zipfile raises NotImplementedError for a zip version or encryption it cannot read
NPZ_READ_ERRORS = (OSError, ValueError, zipfile.BadZipFile, EOFError, NotImplementedError)
#: length of an ``.npy`` header (numpy's own default limit for untrusted files)
MAX_NPY_HEADER_CHARS = 10_000
#: dimensions of one array
MAX_NDIM = 32
#: the scalar types an uploaded array may hold: floats, and the integer counters and bool /
#: uint8 buffers of a ``state_dict`` (:data:`fedfusion.core.state.WIRE_DTYPES`)
UPLOAD_DTYPES: tuple[type, ...] = tuple(dict.fromkeys(d.type for d in WIRE_DTYPES.values()))


def zip_directory_bytes(handle: IO[bytes]) -> int:
    """The size of the central directory a zip file's end record declares (0 when there is
    none), read before :class:`zipfile.ZipFile` turns the directory into one object per
    entry, so that a reader can cap that work first."""
    # the end record ZipFile itself reads (private, but it decides how many directory bytes
    # ZipFile parses: a parser of our own could disagree with it)
    end = zipfile._EndRecData(handle)
    return int(end[zipfile._ECD_SIZE]) if end else 0


def checked_shape(name: str, shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of at most :data:`MAX_NDIM` sizes in ``0..2**62``; raises
    ValueError naming the array otherwise (a declared shape is untrusted)."""
    if not isinstance(shape, tuple | list) or len(shape) > MAX_NDIM or not all(
            isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**62 for s in shape):
        raise ValueError(f"array {name!r} has shape {brief(shape)}, not a tuple of at most "
                         f"{MAX_NDIM} sizes >= 0")
    return tuple(shape)


@dataclass(frozen=True)
class NpyLayout:
    """What an ``.npy`` header declares, checked: its data is ``nbytes`` bytes at ``offset``."""

    dtype: np.dtype
    shape: tuple[int, ...]
    fortran: bool
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def npy_layout(stream: IO[bytes], size: int, name: str,
                declared: tuple[np.dtype, tuple[int, ...]] | None = None,
                dtypes: tuple[type, ...] | None = None) -> NpyLayout:
    """Read and check the header of one ``.npy`` of ``size`` bytes (nothing else is read): a
    float array (or a state entry's integer or bool; ``dtypes`` overrides the scalar types
    allowed), agreeing with ``declared`` (dtype, shape) when given, whose data is exactly the
    rest of the ``size`` bytes."""
    version = np.lib.format.read_magic(stream)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f"array {name!r}: .npy format version {version} is not supported")
    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                   else np.lib.format.read_array_header_2_0)
    shape, fortran, dtype = read_header(stream, max_header_size=MAX_NPY_HEADER_CHARS)
    if declared is not None and (dtype != declared[0] or tuple(shape) != declared[1]):
        raise ValueError(f"array {name!r}: its .npy header says {dtype.str} {brief(shape)}, "
                         f"its declared fields {declared[0].str} {declared[1]}")
    if dtypes is not None and dtype.type not in dtypes:
        raise ValueError(f"array {name!r} has dtype {clip(str(dtype), 40)}; expected one of "
                         f"{', '.join(sorted(np.dtype(t).name for t in dtypes))}")
    if dtypes is None and dtype.type not in UPLOAD_DTYPES:
        raise ValueError(f"array {name!r} has dtype {clip(str(dtype), 40)}; uploads hold "
                         "float16/32/64 arrays (and integer or bool state entries)")
    layout = NpyLayout(dtype, checked_shape(name, shape), fortran, stream.tell())
    if size - layout.offset != layout.nbytes:
        raise ValueError(f"array {name!r} holds {size - layout.offset} data bytes; its shape "
                         f"{layout.shape} and dtype {dtype.str} need {layout.nbytes}")
    return layout


def wire_layout(name: str, array: Array, dtype: np.dtype, shape: tuple[int, ...]
                 ) -> NpyLayout:
    if not isinstance(array.data, bytes | bytearray):
        raise ValueError(f"array {name!r} data is a {type(array.data).__name__}, not bytes")
    return npy_layout(io.BytesIO(array.data), len(array.data), name, declared=(dtype, shape))


def from_buffer(buffer: bytes | bytearray, layout: NpyLayout) -> np.ndarray:
    """The array of a checked layout over ``buffer``: writable, C-ordered, native byte order
    (one copy, unless ``buffer`` is a bytearray already in that form)."""
    flat = np.frombuffer(buffer, dtype=layout.dtype, count=math.prod(layout.shape),
                         offset=layout.offset)
    array = flat.reshape(layout.shape, order="F" if layout.fortran else "C")
    if isinstance(buffer, bytearray) and layout.dtype.isnative and not layout.fortran:
        return array
    # downstream torch.from_numpy refuses non-native byte order: convert while copying
    return np.array(array, dtype=layout.dtype.newbyteorder("="), order="C")


def read_npy(stream: IO[bytes], size: int, name: str, dtypes: tuple[type, ...] | None = None
             ) -> np.ndarray:
    """Decode one ``.npy`` of ``size`` bytes from ``stream`` (a zip member): the header is
    checked first (:func:`npy_layout`), then exactly its data is read, in bounded chunks
    (a zip member inflates as it is read), into one buffer of that size."""
    layout = npy_layout(stream, size, name, dtypes=dtypes)
    buffer = bytearray(layout.nbytes)
    view, filled = memoryview(buffer), 0
    while filled < layout.nbytes:
        chunk = stream.read(min(layout.nbytes - filled, 1 << 24))
        if not chunk:
            raise ValueError(f"array {name!r} is truncated ({filled} of {layout.nbytes} data "
                             "bytes)")
        view[filled:filled + len(chunk)] = chunk
        filled += len(chunk)
    return from_buffer(buffer, dataclasses.replace(layout, offset=0))
