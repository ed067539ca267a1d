"""Byte-level edits of a valid zip (an ``.npz``) for the archive readers' tests."""

from __future__ import annotations


def needs_zip_version(blob: bytes, version: int) -> bytes:
    """``blob`` with its first central-directory entry claiming it needs zip ``version``
    (64: 6.4, above what Python's zipfile reads; it raises NotImplementedError)."""
    at = blob.index(b"PK\x01\x02") + 6  # signature, then version made by, then needed
    return blob[:at] + version.to_bytes(2, "little") + blob[at + 2:]
