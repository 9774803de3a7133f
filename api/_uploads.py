"""Checks of an uploaded ``.npz`` before it is decompressed: the arrays it would become must fit a limit.

A deflated archive can be a thousand times smaller than its arrays (a "zip bomb"): the body limit, which
counts the bytes sent, cannot bound what ``numpy.load`` would allocate. :func:`check_npz_size` reads what the
archive declares (each member's uncompressed size in the zip directory, and each array's shape and dtype in
its ``.npy`` header, of which only the first bytes are decompressed) and refuses the upload if the arrays
would be larger than the limit. What is then loaded cannot grow past it: zipfile stops decompressing a
member at its declared size, and numpy reads exactly ``shape x itemsize`` bytes of it.
"""

from __future__ import annotations

import math
import zipfile
import zlib
from typing import IO

import numpy as np
from numpy.lib import format as npy_format

from distbelief.errors import DatasetError

__all__ = ["UploadTooLargeError", "check_npz_size"]

# A .npy header is at most this long (numpy's own default bound for reading one).
_MAX_HEADER = 10_000


class UploadTooLargeError(DatasetError):
    """An upload whose arrays, once decompressed, would be larger than the limit (HTTP 413)."""


def _too_large(name: str, what: str, size: int, limit: int) -> UploadTooLargeError:
    return UploadTooLargeError(
        f"{name}: {what} would take {size} bytes once decompressed, over the limit of {limit} bytes for "
        "the arrays of an upload (DISTBELIEF_MAX_UPLOAD_BYTES); send a smaller dataset, or split it"
    )


def check_npz_size(file: IO[bytes], limit: int, name: str = "the file") -> None:
    """Refuse an ``.npz`` archive whose arrays would hold more than ``limit`` bytes in all.

    Reads the zip directory and the ``.npy`` header of every member; nothing else is decompressed. The
    file is left at its start.

    Parameters
    ----------
    file : binary file object
        The archive (seekable).
    limit : int
        Most bytes the decompressed arrays may hold together.
    name : str
        How messages call the file.

    Raises
    ------
    UploadTooLargeError
        A member declares (in the zip directory or in its header) more bytes than the limit, or all of them
        together do.
    distbelief.errors.DatasetError
        The archive or a header is unreadable.

    Examples
    --------
    >>> import io
    >>> buf = io.BytesIO(); np.savez_compressed(buf, X=np.zeros((1000, 1000)), y=np.zeros(1000))
    >>> len(buf.getvalue()) < 20_000
    True
    >>> try:
    ...     check_npz_size(buf, limit=2**20)
    ... except UploadTooLargeError as exc:
    ...     print(str(exc)[:74])
    the file: array 'X' (shape (1000, 1000), float64) would take 8000000 bytes
    """
    try:
        with zipfile.ZipFile(file) as archive:
            total = 0
            for info in archive.infolist():
                if info.is_dir():
                    continue
                member = info.filename.removesuffix(".npy")
                nbytes, shape, dtype = _declared(archive, info, name, member)
                if nbytes > limit:
                    raise _too_large(name, f"array {member!r} (shape {shape}, {dtype})", nbytes, limit)
                if info.file_size > limit:  # what zipfile would decompress, header and padding included
                    raise _too_large(name, f"member {member!r}", info.file_size, limit)
                total += nbytes
                if total > limit:
                    raise _too_large(name, "its arrays together", total, limit)
    except DatasetError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error, NotImplementedError) as exc:
        raise DatasetError(f"cannot read {name} as an .npz file: {exc}") from exc
    finally:
        file.seek(0)


def _header(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> tuple[tuple[int, ...], np.dtype]:
    with archive.open(info) as member:
        v1 = npy_format.read_magic(member) == (1, 0)
        read = npy_format.read_array_header_1_0 if v1 else npy_format.read_array_header_2_0
        shape, _, dtype = read(member, max_header_size=_MAX_HEADER)
    return tuple(int(n) for n in shape), np.dtype(dtype)


def _declared(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, member: str
) -> tuple[int, tuple[int, ...], np.dtype]:
    """The bytes, shape and dtype that a member's ``.npy`` header declares."""
    try:
        shape, dtype = _header(archive, info)
    except ValueError as exc:
        raise DatasetError(f"{name}: member {member!r} is not a readable .npy array ({exc})") from exc
    if any(n < 0 for n in shape):
        raise DatasetError(f"{name}: array {member!r} declares a negative shape {shape}")
    # Python integers: a shape of (10**12, 10) must not overflow on its way to the comparison.
    return math.prod(shape) * max(dtype.itemsize, 1), shape, dtype
