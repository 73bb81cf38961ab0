"""Per-table storage settings suited to a queue: every job is updated and deleted within
minutes, so dead tuples pile up far faster than the global autovacuum defaults assume."""

from django.db import migrations

SETTINGS = (
    # Vacuum after ~2% of the table is dead (default 20%), analyze after 5% changed (default
    # 10%), never throttle vacuum on this table, and leave 10% of each page free so heartbeats
    # (which touch only unindexed columns) can be HOT updates on the same page.
    "autovacuum_vacuum_scale_factor = 0.02, autovacuum_vacuum_threshold = 1000, "
    "autovacuum_analyze_scale_factor = 0.05, autovacuum_vacuum_cost_delay = 0, "
    "fillfactor = 90"
)


class Migration(migrations.Migration):
    dependencies = [("pgjobs", "0001_initial")]

    operations = [
        migrations.RunSQL(
            f"ALTER TABLE pgjobs_job SET ({SETTINGS})",
            "ALTER TABLE pgjobs_job RESET (autovacuum_vacuum_scale_factor, "
            "autovacuum_vacuum_threshold, autovacuum_analyze_scale_factor, "
            "autovacuum_vacuum_cost_delay, fillfactor)",
        )
    ]
