"""What happens after an order is placed, outside the request.

The view enqueues ``send_confirmation`` and ``charge_card`` in the transaction that creates the
order; ``charge_card`` enqueues ``notify_warehouse`` and ``issue_invoice`` in the transaction
that records the payment. Jobs run at least once, so each handler checks what an earlier
attempt already did.
"""

from __future__ import annotations

from django.core.mail import send_mail
from django.db import transaction
from django.db.models.functions import Now
from django.utils import timezone

from django_pgjobs import PermanentError, task
from django_pgjobs.retry import ExponentialBackoff
from example_project.shop import services
from example_project.shop.models import Order

#: VAT rates (percent) by country. An order to any other country cannot be invoiced.
VAT_RATES = {"GB": 20, "DE": 19, "FR": 20, "IE": 23, "NL": 21, "US": 0}


@task(queue="emails")
def send_confirmation(order_id: int) -> None:
    # Order.DoesNotExist is a permanent error: no retry can bring the order back.
    order = Order.objects.get(pk=order_id)
    if order.confirmation_sent_at:
        return
    send_mail(
        subject=f"Thank you for your order {order.pk}",
        message=f"We received your order: {order}. We will email you when it ships.",
        from_email="shop@example.com",
        recipient_list=[order.email],
    )
    Order.objects.filter(pk=order.pk).update(confirmation_sent_at=Now())


@task(queue="payments", max_attempts=10)
def charge_card(order_id: int) -> None:
    with transaction.atomic():
        # The row lock makes a second, concurrent run of this job wait here, then see paid_at.
        order = Order.objects.select_for_update().get(pk=order_id)
        if order.paid_at:
            return
        # The gateway's idempotency key makes a charge repeated after a crash harmless.
        order.charge_id = services.charge(order.amount_cents, idempotency_key=f"order-{order.pk}")
        order.paid_at = timezone.now()
        order.save(update_fields=["charge_id", "paid_at"])
        # Enqueued in the transaction that records the payment: both or neither.
        notify_warehouse.enqueue(order_id=order.pk)
        issue_invoice.enqueue(order_id=order.pk)


# The warehouse API times out now and then: retry soon, up to 8 attempts in all.
@task(queue="warehouse", max_attempts=8, backoff=ExponentialBackoff(base=0.25, cap=2.0))
def notify_warehouse(order_id: int) -> None:
    order = Order.objects.get(pk=order_id)
    if order.shipped_at:
        return
    services.ship(order.pk, order.product, order.quantity)
    Order.objects.filter(pk=order.pk).update(shipped_at=Now())


@task
def issue_invoice(order_id: int) -> None:
    order = Order.objects.get(pk=order_id)
    if order.invoiced_at:
        return
    if order.country not in VAT_RATES:
        # Bad data: no retry will fix it. The job goes to the dead letters at once; correct
        # the order (or VAT_RATES) and replay it from the admin.
        raise PermanentError(
            f"order {order.pk}: no VAT rate for country {order.country!r} "
            f"(known: {', '.join(sorted(VAT_RATES))})"
        )
    Order.objects.filter(pk=order.pk).update(
        invoice_number=f"INV-{order.pk:06d}", invoiced_at=Now()
    )
