"""Placing an order: the order and the jobs that follow it are written in one transaction."""

from __future__ import annotations

from django.contrib import messages
from django.db import transaction
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect, render

from example_project.shop import tasks
from example_project.shop.forms import OrderForm
from example_project.shop.models import Order


def place_order(request: HttpRequest) -> HttpResponse:
    form = OrderForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        # Both jobs commit with the order, or nothing does: a worker can never see a job for
        # an order that was rolled back, and no order is left without its jobs.
        with transaction.atomic():
            order = form.save()
            tasks.send_confirmation.enqueue(order_id=order.pk)
            tasks.charge_card.enqueue(order_id=order.pk)
        messages.success(request, f"Order {order.pk} placed; a worker will confirm and charge it.")
        return redirect("shop:place_order")
    recent = Order.objects.order_by("-pk")[:10]
    return render(request, "shop/place_order.html", {"form": form, "orders": recent})
