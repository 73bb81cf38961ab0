"""A small shop that shows django-pgjobs at work: run it with ``python manage.py demo``."""
