"""Time-ordered job ids."""

from __future__ import annotations

import os
import time
import uuid


def uuid7() -> uuid.UUID:
    """A UUID version 7 (RFC 9562): new rows land at the right edge of the primary key index."""
    unix_ms = time.time_ns() // 1_000_000
    value = (unix_ms & 0xFFFF_FFFF_FFFF) << 80 | int.from_bytes(os.urandom(10)) & ((1 << 80) - 1)
    value = value & ~(0xF << 76) | 0x7 << 76  # version 7
    value = value & ~(0x3 << 62) | 0x2 << 62  # RFC 4122 variant
    return uuid.UUID(int=value)
