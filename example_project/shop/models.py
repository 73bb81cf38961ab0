"""An order, and how far the jobs that follow it have got."""

from __future__ import annotations

from django.db import models
from django.db.models.functions import Now


class Product(models.TextChoices):
    MUG = "mug", "Mug"
    TSHIRT = "tshirt", "T-shirt"
    POSTER = "poster", "Poster"


PRICES_CENTS = {Product.MUG: 1200, Product.TSHIRT: 2500, Product.POSTER: 900}


class Order(models.Model):
    email = models.EmailField()
    product = models.CharField(max_length=20, choices=Product.choices)
    quantity = models.PositiveSmallIntegerField(default=1)
    country = models.CharField(max_length=2, help_text="ISO 3166 country code, e.g. GB")
    amount_cents = models.PositiveIntegerField()
    created_at = models.DateTimeField(db_default=Now())
    # Filled in by the jobs, each at most once (they run at least once).
    confirmation_sent_at = models.DateTimeField(null=True, blank=True)
    charge_id = models.CharField(max_length=100, blank=True, default="")
    paid_at = models.DateTimeField(null=True, blank=True)
    shipped_at = models.DateTimeField(null=True, blank=True)
    invoice_number = models.CharField(max_length=20, blank=True, default="")
    invoiced_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"Order {self.pk} ({self.quantity} × {self.get_product_display()})"

    @property
    def progress(self) -> str:
        if self.invoiced_at:
            return "invoiced"
        if self.paid_at:
            return "paid"
        return "placed"

    @staticmethod
    def price(product: str, quantity: int) -> int:
        return PRICES_CENTS[Product(product)] * quantity
