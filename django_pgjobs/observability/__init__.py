"""Observability: the figures read back (the job table, the QueueStat rows workers write,
PostgreSQL's statistics), the health verdict and the report. It only reads.

Each module imports only those before it: stats, dbstats, load, figures, health, report.
"""
