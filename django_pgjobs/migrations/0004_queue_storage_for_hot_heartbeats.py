"""Storage for cheaper state changes: the unique-key index skips rows without a key, and pages
keep 30% free so a job's claim and its heartbeats fit on its own page.

Measured by the benchmark (docs/performance.md): at fillfactor 90 the claim's new row version
took the free space and only ~20% of first heartbeats were HOT; at 70, most are.

The unique index is rebuilt without locking the table (CONCURRENTLY, so not atomic): a new
index is built beside the old one, which is then dropped, and the new one takes its name.
"""

UNIQUE_KEY_INDEX = (
    'CREATE UNIQUE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" ("unique_key") '
    "WHERE (\"status\" IN ('ready', 'running') AND \"unique_key\" IS NOT NULL)"
)
OLD_UNIQUE_KEY_INDEX = (
    'CREATE UNIQUE INDEX CONCURRENTLY "pgjobs_job_unique_key_live" ON "pgjobs_job" '
    "(\"unique_key\") WHERE \"status\" IN ('ready', 'running')"
)

from django.db import migrations, models


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('pgjobs', '0003_deadletter'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(
                    model_name='job',
                    name='pgjobs_job_unique_key_live',
                ),
                migrations.AddConstraint(
                    model_name='job',
                    constraint=models.UniqueConstraint(condition=models.Q(('status__in', ('ready', 'running')), ('unique_key__isnull', False)), fields=('unique_key',), name='pgjobs_job_unique_key_live'),
                ),
            ],
            database_operations=[
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "pgjobs_job_unique_key_new"',
                    migrations.RunSQL.noop,
                ),
                migrations.RunSQL(
                    UNIQUE_KEY_INDEX.format(name="pgjobs_job_unique_key_new"),
                    'DROP INDEX CONCURRENTLY "pgjobs_job_unique_key_new"',
                ),
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "pgjobs_job_unique_key_live"',
                    OLD_UNIQUE_KEY_INDEX,
                ),
                migrations.RunSQL(
                    'ALTER INDEX "pgjobs_job_unique_key_new" RENAME TO "pgjobs_job_unique_key_live"',
                    'ALTER INDEX "pgjobs_job_unique_key_live" RENAME TO "pgjobs_job_unique_key_new"',
                ),
            ],
        ),
        # Applies to pages written from now on; existing pages keep their fill.
        migrations.RunSQL(
            "ALTER TABLE pgjobs_job SET (fillfactor = 70)",
            "ALTER TABLE pgjobs_job SET (fillfactor = 90)",
        ),
    ]
