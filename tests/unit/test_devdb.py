"""The development database's configuration (devdb.py): a DATABASE_URL Django cannot use is one
line saying what is wrong, before the start-up check says the database is fine."""

from __future__ import annotations

import pytest

import devdb


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("postgres://postgres@127.0.0.1:5432/", "names no database"),
        (
            "mysql://root@127.0.0.1/shop",
            "must be a PostgreSQL URL (postgres://USER@HOST:5432/NAME), not mysql's",
        ),
        ("sqlite:////tmp/shop.db", "not sqlite3's"),
        ("garbage", "must be a PostgreSQL URL"),
    ],
)
def test_a_database_url_django_cannot_use_is_one_line(monkeypatch, url, said):
    # Each was "PostgreSQL 15" from the start-up check, then an 80-line traceback from Django.
    monkeypatch.setenv("DATABASE_URL", url)
    with pytest.raises(devdb.DatabaseUnavailable) as raised:
        devdb.database_config()
    assert said in str(raised.value.code)


def test_the_start_up_check_connects_with_the_urls_options(monkeypatch):
    # It ignored them, and said the database was fine where Django then failed (sslmode=require
    # on a server without SSL; a bad connect_timeout).
    monkeypatch.setenv("DATABASE_URL", "postgres://nobody@127.0.0.1:1/shop?connect_timeout=abc")
    with pytest.raises(devdb.DatabaseUnavailable, match="bad value for connect_timeout"):
        devdb.describe(devdb.database_config(), must_exist=True)
