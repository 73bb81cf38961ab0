"""Stand-ins for the outside world: a payment gateway that honours idempotency keys, and a
warehouse API that times out now and then."""

from __future__ import annotations

import hashlib
import random
import time

#: The share of warehouse calls that time out.
WAREHOUSE_FAILURE_RATE = 0.25


class WarehouseUnavailable(ConnectionError):
    """The warehouse API did not answer in time (transient: another attempt may succeed)."""


def charge(amount_cents: int, *, idempotency_key: str) -> str:
    """Charge the customer's card; the same key always returns the same charge."""
    _latency()
    return "ch_" + hashlib.sha256(idempotency_key.encode()).hexdigest()[:16]


def ship(order_id: int, product: str, quantity: int) -> None:
    """Ask the warehouse to ship an order. Shipping the same order twice ships it once."""
    _latency()
    if random.random() < WAREHOUSE_FAILURE_RATE:
        raise WarehouseUnavailable(f"warehouse API timed out shipping order {order_id}")


def _latency() -> None:
    time.sleep(random.uniform(0.005, 0.03))
