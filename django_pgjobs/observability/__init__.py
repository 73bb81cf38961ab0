"""Observability: the figures read back (the job table, the workers' statistics and their
rollup, PostgreSQL's statistics), the health verdict, the report, and the per-task figures of
the dashboard. It only reads.

Each module imports only those before it: stats, dbstats, load, figures, health, report, tasks.
"""
