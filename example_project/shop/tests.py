"""The shop's own tests, written as a project tests its jobs: Django's TestCase with
django_pgjobs.testing. Jobs enqueued in the test's transaction are visible to assert_enqueued
and run by run_jobs, on the test's connection, without a worker."""

from __future__ import annotations

from datetime import timedelta
from unittest import mock

from django.core import mail
from django.test import TestCase, override_settings
from django.urls import reverse

from django_pgjobs.models import Job
from django_pgjobs.status import Status
from django_pgjobs.testing import assert_enqueued, assert_not_enqueued, run_jobs
from example_project.shop import services, tasks
from example_project.shop.models import Order

ORDER = {"email": "ada@example.com", "product": "mug", "quantity": "2", "country": "gb"}


@override_settings(ROOT_URLCONF="example_project.urls")
class PlacingAnOrderTests(TestCase):
    def place(self, **changes: str) -> Order:
        response = self.client.post(reverse("shop:place_order"), {**ORDER, **changes})
        self.assertEqual(response.status_code, 302)
        return Order.objects.get()

    def test_placing_an_order_enqueues_its_confirmation_and_its_charge(self) -> None:
        order = self.place()

        assert_enqueued(tasks.send_confirmation, order_id=order.pk)
        charge = assert_enqueued(tasks.charge_card, order_id=order.pk)
        self.assertEqual(charge.queue, "payments")
        assert_not_enqueued(tasks.notify_warehouse)  # only once the card is charged

    def test_an_invalid_order_enqueues_nothing(self) -> None:
        response = self.client.post(reverse("shop:place_order"), {**ORDER, "country": "G1"})

        self.assertEqual(response.status_code, 200)
        assert_not_enqueued(tasks.send_confirmation)
        assert_not_enqueued(tasks.charge_card)

    @mock.patch.object(services, "WAREHOUSE_FAILURE_RATE", 0.0)
    def test_the_jobs_confirm_charge_ship_and_invoice_the_order(self) -> None:
        order = self.place()

        run = run_jobs()

        self.assertEqual(run.counts, {Status.SUCCEEDED: 4})
        order.refresh_from_db()
        self.assertTrue(order.confirmation_sent_at and order.paid_at and order.shipped_at)
        self.assertEqual(order.invoice_number, f"INV-{order.pk:06d}")
        self.assertEqual(mail.outbox[0].to, ["ada@example.com"])

    @mock.patch.object(services, "WAREHOUSE_FAILURE_RATE", 0.0)
    def test_a_charged_order_is_shipped_and_invoiced_by_the_jobs_the_charge_enqueues(
        self,
    ) -> None:
        order = self.place()

        run_jobs(tasks=[tasks.charge_card])

        assert_enqueued(tasks.notify_warehouse, order_id=order.pk)
        assert_enqueued(tasks.issue_invoice, order_id=order.pk)
        assert_enqueued(tasks.send_confirmation, order_id=order.pk)  # not selected: still there

    def test_an_order_to_a_country_without_a_vat_rate_ends_as_a_dead_letter(self) -> None:
        self.place(country="uk")

        run = run_jobs(tasks=[tasks.charge_card, tasks.issue_invoice])

        [invoice] = [job for job in run.jobs if job.task.endswith("issue_invoice")]
        self.assertEqual(invoice.status, Status.FAILED)
        self.assertIn("no VAT rate for country 'UK'", invoice.last_error)

    @mock.patch.object(services, "WAREHOUSE_FAILURE_RATE", 1.0)
    def test_a_warehouse_that_never_answers_is_tried_eight_times_then_dead_lettered(
        self,
    ) -> None:
        order = self.place()

        # Time travel: each retry's backoff is over at once, so all eight attempts run now.
        run_jobs(advance=timedelta(minutes=5))

        order.refresh_from_db()
        self.assertIsNone(order.shipped_at)
        assert_not_enqueued(tasks.notify_warehouse)
        dead = Job.objects.dead().get(task=tasks.notify_warehouse.name)
        self.assertEqual((dead.attempts, dead.payload), (8, {"order_id": order.pk}))
