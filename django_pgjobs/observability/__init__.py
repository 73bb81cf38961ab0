"""Observability: the figures read back (the job table, the QueueStat rows workers write,
PostgreSQL's statistics), the health verdict and the report. It only reads.

Each module imports only those listed before it:

- stats: the queues' depth (job table), recent activity and live workers (QueueStat rows);
- dbstats: the job table's and the database's figures (PostgreSQL's statistics views);
- load: the queue's share of the database's active time;
- figures: all of them at one moment;
- health: the verdict on the figures, against PGJOBS["HEALTH"];
- report: figures and verdict, as `jobstats`, the admin and django_pgjobs.metrics show them.
"""
