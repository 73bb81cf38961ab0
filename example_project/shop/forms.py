from __future__ import annotations

from typing import Any

from django import forms

from example_project.shop.models import Order


class OrderForm(forms.ModelForm):
    class Meta:
        model = Order
        fields = ["email", "product", "quantity", "country"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["quantity"].widget.attrs["min"] = 1

    def clean_country(self) -> str:
        country: str = self.cleaned_data["country"].strip().upper()
        if len(country) != 2 or not country.isalpha():
            raise forms.ValidationError("Enter a two-letter country code, e.g. GB.")
        return country

    def save(self, commit: bool = True) -> Order:
        order: Order = super().save(commit=False)
        order.amount_cents = Order.price(order.product, order.quantity)
        if commit:
            order.save()
        return order
