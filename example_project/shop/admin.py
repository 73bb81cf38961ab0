from __future__ import annotations

from django.contrib import admin

from example_project.shop.models import Order


@admin.register(Order)
class OrderAdmin(admin.ModelAdmin):
    list_display = ["id", "email", "product", "quantity", "country", "progress", "created_at"]
    list_filter = ["product", "country"]
    search_fields = ["=id", "email"]
    readonly_fields = ["created_at"]
