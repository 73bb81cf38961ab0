from __future__ import annotations

from django.apps import AppConfig


class TestsConfig(AppConfig):
    name = "tests"
    label = "tests"
