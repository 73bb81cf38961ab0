"""The dead letters' index also holds each one's queue and task, so that the report and the
dashboard count them by queue and task from the index alone, not from the rows spread over
the whole table.

Built beside the old index without locking writers out (CREATE INDEX CONCURRENTLY, so the
migration is not atomic); if it is interrupted, run migrate again: it goes on from where it
stopped (django_pgjobs.migrating).
"""

from django.db import migrations, models

from django_pgjobs.migrating import ReplaceIndexConcurrently

DEAD_INDEX = (
    'CREATE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" ("id" DESC) INCLUDE ("queue", "task") '
    'WHERE ("status" = \'failed\')'
)
OLD_DEAD_INDEX = (
    'CREATE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" ("id" DESC) WHERE ("status" = \'failed\')'
)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('pgjobs', '0018_rollups'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(model_name='job', name='pgjobs_job_dead_idx'),
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(condition=models.Q(('status', 'failed')), fields=['-id'], include=('queue', 'task'), name='pgjobs_job_dead_idx'),
                ),
            ],
            database_operations=[
                ReplaceIndexConcurrently(
                    "pgjobs_job_dead_idx",
                    building="pgjobs_job_dead_new",
                    sql=DEAD_INDEX,
                    reverse_sql=OLD_DEAD_INDEX,
                    marker="INCLUDE",  # pg_get_indexdef of the new one only
                ),
            ],
        ),
    ]
