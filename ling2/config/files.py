"""File checksums shared by the index cache and the checkpoint manager."""

import zlib

_CHUNK = 8 << 20


def crc32(path) -> int:
    """CRC-32 of a file's bytes, read in 8 MiB chunks."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc
