"""The admin's search and filter by task: an index on `task`; and the permission to edit a
failed or cancelled job's payload before replay.

Built without locking writers out (CREATE INDEX CONCURRENTLY, so the migration is not atomic):
workers and enqueues keep running while it builds. If it is interrupted, run migrate again; a
half-built index left INVALID is dropped and built again (django_pgjobs.migrating).
"""

from django.db import migrations, models

from django_pgjobs.migrating import CreateIndexConcurrently

TASK_INDEX = 'CREATE INDEX CONCURRENTLY "pgjobs_job_task_idx" ON "pgjobs_job" ("task")'


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('pgjobs', '0008_scheduled'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='job',
            options={'permissions': [('replay_job', 'Can replay failed or cancelled jobs'), ('cancel_job', 'Can cancel jobs'), ('edit_payload_job', "Can edit a failed or cancelled job's payload before replay")], 'verbose_name': 'job', 'verbose_name_plural': 'jobs'},
        ),
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(fields=['task'], name='pgjobs_job_task_idx'),
                ),
            ],
            database_operations=[
                CreateIndexConcurrently("pgjobs_job_task_idx", TASK_INDEX),
            ],
        ),
    ]
