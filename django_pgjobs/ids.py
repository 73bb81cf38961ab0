"""Time-ordered job ids."""

from __future__ import annotations

import os
import time
import uuid

#: The version (7) and variant (RFC 4122) bits, and the 74 random bits around them.
_VERSION_AND_VARIANT = 0x7 << 76 | 0x2 << 62
_RANDOM = ((1 << 80) - 1) & ~(0xF << 76) & ~(0x3 << 62)


def uuid7(unix_seconds: float | None = None) -> uuid.UUID:
    """A UUID version 7 (RFC 9562): new rows land at the right edge of the primary key index.
    Made for now, or for the moment `unix_seconds` (e.g. tests of old jobs)."""
    now_ms = time.time_ns() // 1_000_000
    unix_ms = now_ms if unix_seconds is None else int(unix_seconds * 1000)
    random = int.from_bytes(os.urandom(10)) & _RANDOM
    return uuid.UUID(int=(unix_ms & 0xFFFF_FFFF_FFFF) << 80 | _VERSION_AND_VARIANT | random)


def uuid7_batch(count: int) -> list[uuid.UUID]:
    """`count` UUIDv7 of this millisecond in ascending order (RFC 9562's monotonic random
    method), so a bulk insert appends to the primary key index's rightmost page. Steps are
    random, up to 2**32, from below 2**61, so none carries into the variant bits."""
    unix_ms = time.time_ns() // 1_000_000
    high = (unix_ms & 0xFFFF_FFFF_FFFF) << 80 | _VERSION_AND_VARIANT
    entropy = os.urandom(10 + 4 * count)
    # The 12 bits above the variant are random and fixed for the batch; the 62 below count up.
    start = int.from_bytes(entropy[:10]) & _RANDOM
    value = high | start & ~((1 << 62) - 1) | start & ((1 << 61) - 1)  # room for the steps
    ids = []
    for n in range(count):
        value += 1 + int.from_bytes(entropy[10 + 4 * n : 14 + 4 * n])
        ids.append(uuid.UUID(int=value))
    return ids


def uuid7_floor(unix_seconds: float) -> uuid.UUID:
    """The smallest UUIDv7 of that moment: every id made earlier (by a clock that agrees) sorts
    below it, in Python and in PostgreSQL's uuid order alike."""
    unix_ms = max(0, int(unix_seconds * 1000))
    value = (unix_ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | 0x2 << 62
    return uuid.UUID(int=value)
