"""File helpers shared by the data downloads, the checkpoint manifests and the sweep's base-model record."""

from __future__ import annotations

import hashlib


def file_sha256(path: str, block_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes, read `block_bytes` at a time (never the whole file in memory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(block_bytes), b""):
            digest.update(block)
    return digest.hexdigest()
