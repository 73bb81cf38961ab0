from __future__ import annotations

from django.urls import path

from example_project.shop import views

app_name = "shop"
urlpatterns = [path("", views.place_order, name="place_order")]
