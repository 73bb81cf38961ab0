"""Observability: what workers record, the figures read back, the health verdict and the report."""
