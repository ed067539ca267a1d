"""Files named from outside (a run config, an operator, a replay's manifest): regular files
only, read within a cap. Reading a FIFO blocks until some writer comes, and a device such as
``/dev/zero`` never ends, so neither is opened."""

from __future__ import annotations

import os
import stat

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory",
          stat.S_IFSOCK: "a socket"}


def regular_file_size(path: str | os.PathLike[str]) -> int:
    """The size of ``path`` (symlinks followed); ValueError ``"is a FIFO, not a regular
    file"`` (to follow the file's name) unless it is a regular file; OSError where it cannot
    be stat'ed."""
    status = os.stat(path)
    if not stat.S_ISREG(status.st_mode):
        kind = _KINDS.get(stat.S_IFMT(status.st_mode), "something else")
        raise ValueError(f"is {kind}, not a regular file")
    return status.st_size


def read_capped(path: str | os.PathLike[str], cap: int) -> bytes:
    """The bytes of the regular file ``path``, at most ``cap`` of them: ValueError ``"is above
    the cap of <cap> bytes"`` when it holds more (it may have grown since a size check)."""
    regular_file_size(path)
    with open(path, "rb") as handle:
        data = handle.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"is above the cap of {cap} bytes")
    return data
