"""The example shop: an order and its jobs are written together or not at all."""

from __future__ import annotations

from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse

from django_pgjobs import PermanentError
from django_pgjobs.models import Job
from django_pgjobs.retry import is_permanent
from django_pgjobs.status import Status
from example_project.shop import services, tasks
from example_project.shop.models import Order, Product

pytestmark = [pytest.mark.django_db, pytest.mark.urls("example_project.urls")]

ORDER = {"email": "ada@example.com", "product": "mug", "quantity": "2", "country": "gb"}


def place(client: Client, **changes: str) -> Any:
    return client.post(reverse("shop:place_order"), {**ORDER, **changes})


def transaction_id(table: str, pk: object) -> int:
    """The id of the transaction that wrote the row (its xmin)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT xmin::text::bigint FROM {table} WHERE id = %s", [pk])
        return int(cursor.fetchone()[0])


def make_order(country: str = "GB") -> Order:
    return Order.objects.create(
        email="ada@example.com",
        product=Product.MUG,
        quantity=1,
        country=country,
        amount_cents=Order.price(Product.MUG, 1),
    )


@pytest.mark.django_db(
    transaction=True
)  # the view's own transaction, not a savepoint in the test's
def test_placing_an_order_commits_the_order_and_its_two_jobs_in_one_transaction(client):
    response = place(client)

    assert response.status_code == 302
    order = Order.objects.get()
    assert (order.country, order.amount_cents) == ("GB", 2400)
    jobs = Job.objects.order_by("task")
    assert [(job.task, job.queue, job.payload, job.status) for job in jobs] == [
        ("example_project.shop.tasks.charge_card", "payments", {"order_id": order.pk}, "ready"),
        ("example_project.shop.tasks.send_confirmation", "emails", {"order_id": order.pk}, "ready"),
    ]
    writers = {transaction_id("pgjobs_job", job.pk) for job in jobs}
    assert writers == {transaction_id("shop_order", order.pk)}


class GatewayDown(Exception):
    pass


class FailingTask:
    def enqueue(self, **kwargs: Any) -> None:
        raise GatewayDown


@pytest.mark.django_db(transaction=True)  # the view's own transaction rolled back, not a savepoint
def test_a_view_that_fails_after_enqueueing_writes_neither_the_order_nor_any_job(
    client, monkeypatch
):
    # send_confirmation is enqueued (and the order saved) before charge_card's enqueue fails.
    monkeypatch.setattr(tasks, "charge_card", FailingTask())

    with pytest.raises(GatewayDown):
        place(client)

    assert Order.objects.count() == 0
    assert Job.objects.count() == 0


def test_an_invalid_order_is_shown_again_and_writes_nothing(client):
    response = place(client, country="G1")

    assert response.status_code == 200
    assert "two-letter country code" in response.content.decode()
    assert (Order.objects.count(), Job.objects.count()) == (0, 0)


def test_charging_an_order_twice_charges_once_and_enqueues_its_follow_up_jobs_once():
    order = make_order()

    tasks.charge_card(order_id=order.pk)
    order.refresh_from_db()
    charged = (order.charge_id, order.paid_at)
    tasks.charge_card(order_id=order.pk)  # a second delivery of the same job

    order.refresh_from_db()
    assert (order.charge_id, order.paid_at) == charged and order.charge_id.startswith("ch_")
    assert sorted(Job.objects.values_list("task", flat=True)) == [
        "example_project.shop.tasks.issue_invoice",
        "example_project.shop.tasks.notify_warehouse",
    ]


def test_an_invoice_for_a_country_without_a_vat_rate_is_a_permanent_error():
    order = make_order(country="UK")

    with pytest.raises(PermanentError, match="no VAT rate for country 'UK'") as raised:
        tasks.issue_invoice(order_id=order.pk)

    assert is_permanent(raised.value)


def test_a_warehouse_timeout_is_a_transient_error(monkeypatch):
    monkeypatch.setattr(services, "WAREHOUSE_FAILURE_RATE", 1.0)
    order = make_order()

    with pytest.raises(services.WarehouseUnavailable) as raised:
        tasks.notify_warehouse(order_id=order.pk)

    assert not is_permanent(raised.value, tasks.notify_warehouse.permanent_errors)
    assert Order.objects.get(pk=order.pk).shipped_at is None


@pytest.mark.django_db(transaction=True)  # the worker's handler threads have their own connections
@pytest.mark.usefixtures("signal_handlers_restored")
def test_a_worker_confirms_and_charges_a_placed_order(client):
    place(client)
    order = Order.objects.get()

    call_command("runjobs", "--once", "--queue", "emails", "--queue", "payments", verbosity=0)

    order.refresh_from_db()
    assert order.confirmation_sent_at and order.paid_at
    assert Job.objects.filter(status=Status.SUCCEEDED).count() == 2
