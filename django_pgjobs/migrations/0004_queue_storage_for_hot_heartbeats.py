"""Storage for cheaper state changes: the unique-key index skips rows without a key, and pages
keep 30% free so a job's claim and its heartbeats fit on its own page.

Measured by the benchmark (docs/performance.md): at fillfactor 90 the claim's new row version
took the free space and only ~20% of first heartbeats were HOT; at 70, most are.

The unique index is rebuilt without locking writers out (CONCURRENTLY, so not atomic): a new
index is built beside the old one, which is then dropped, and the new one takes its name. Run
again after an interruption, it goes on from where it stopped (django_pgjobs.migrating).
"""

from django.db import migrations, models

from django_pgjobs.migrating import ReplaceIndexConcurrently

UNIQUE_KEY_INDEX = (
    'CREATE UNIQUE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" ("unique_key") '
    "WHERE (\"status\" IN ('ready', 'running') AND \"unique_key\" IS NOT NULL)"
)
OLD_UNIQUE_KEY_INDEX = (
    'CREATE UNIQUE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" '
    "(\"unique_key\") WHERE \"status\" IN ('ready', 'running')"
)


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
                ReplaceIndexConcurrently(
                    "pgjobs_job_unique_key_live",
                    building="pgjobs_job_unique_key_new",
                    sql=UNIQUE_KEY_INDEX,
                    reverse_sql=OLD_UNIQUE_KEY_INDEX,
                    marker="unique_key IS NOT NULL",  # pg_get_indexdef of the new one only
                ),
            ],
        ),
        # A storage parameter: a SHARE UPDATE EXCLUSIVE lock, which no insert, claim or update
        # waits for. Applies to pages written from now on; existing pages keep their fill.
        migrations.RunSQL(
            "ALTER TABLE pgjobs_job SET (fillfactor = 70)",
            "ALTER TABLE pgjobs_job SET (fillfactor = 90)",
        ),
    ]
