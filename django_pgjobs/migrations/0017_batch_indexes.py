"""Batches and dependencies, second step: the job table's status checks replaced in 0016 are
checked, and its indexes of a batch's jobs and of waiting jobs built, without locking writers
out (VALIDATE CONSTRAINT, CREATE INDEX CONCURRENTLY: the migration is not atomic). If it is
interrupted, run migrate again: it goes on from where it stopped.
"""

from django.db import migrations, models

from django_pgjobs.migrating import CreateIndexConcurrently

VALIDATE = """
    ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_status_valid;
    ALTER TABLE pgjobs_job VALIDATE CONSTRAINT pgjobs_job_finished_iff_finished_at
"""
BATCH_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_batch_idx" ON "pgjobs_job" ("batch_id", "status") '
    'WHERE "batch_id" IS NOT NULL'
)
WAITING_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_waiting_idx" ON "pgjobs_job" ("id") '
    "WHERE \"status\" = 'waiting'"
)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('pgjobs', '0016_batches'),
    ]

    operations = [
        migrations.RunSQL(VALIDATE, reverse_sql=migrations.RunSQL.noop),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(condition=models.Q(('batch__isnull', False)), fields=['batch', 'status'], name='pgjobs_job_batch_idx'),
                ),
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(condition=models.Q(('status', 'waiting')), fields=['id'], name='pgjobs_job_waiting_idx'),
                ),
            ],
            database_operations=[
                CreateIndexConcurrently("pgjobs_job_batch_idx", BATCH_INDEX),
                CreateIndexConcurrently("pgjobs_job_waiting_idx", WAITING_INDEX),
            ],
        ),
    ]
