"""Flow control, second step: a limited task's jobs wait in an index of their own, by task and
limit key, out of the claim index, so that a claim of the other jobs never reads them and a key
at its limit never holds back another (data/sql.py, CLAIM_KEYED).

Built without locking writers out (CREATE INDEX CONCURRENTLY, so the migration is not atomic).
If it is interrupted, run migrate again: it goes on from where it stopped. The claim index is
replaced: until they restart, workers of the previous release cannot use it and claim by
scanning the table, so restart them soon after migrate (docs/howto/upgrading.md).
"""

from django.db import migrations, models

from django_pgjobs.migrating import CreateIndexConcurrently, ReplaceIndexConcurrently

CLAIM_INDEX = (
    'CREATE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" ("queue", "priority" DESC, "run_at", '
    '"id") WHERE ("limit_key" IS NULL AND NOT "scheduled" AND "status" = \'ready\')'
)
OLD_CLAIM_INDEX = (
    'CREATE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" '
    '("queue", "priority" DESC, "run_at", "id") WHERE (NOT "scheduled" AND "status" = \'ready\')'
)
KEYED_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_keyed_idx" ON "pgjobs_job" ("queue", "task", '
    '"limit_key", "priority" DESC, "run_at", "id") '
    'WHERE ("limit_key" IS NOT NULL AND NOT "scheduled" AND "status" = \'ready\')'
)
KEYED_RUNNING_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_keyed_running_idx" ON "pgjobs_job" ("task", '
    '"limit_key") WHERE ("limit_key" IS NOT NULL AND "status" = \'running\')'
)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('pgjobs', '0014_flow_control'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveIndex(
                    model_name='job',
                    name='pgjobs_job_claim_idx',
                ),
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(condition=models.Q(('limit_key__isnull', True), ('scheduled', False), ('status', 'ready')), fields=['queue', '-priority', 'run_at', 'id'], name='pgjobs_job_claim_idx'),
                ),
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(condition=models.Q(('limit_key__isnull', False), ('scheduled', False), ('status', 'ready')), fields=['queue', 'task', 'limit_key', '-priority', 'run_at', 'id'], name='pgjobs_job_keyed_idx'),
                ),
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(condition=models.Q(('limit_key__isnull', False), ('status', 'running')), fields=['task', 'limit_key'], name='pgjobs_job_keyed_running_idx'),
                ),
            ],
            database_operations=[
                CreateIndexConcurrently("pgjobs_job_keyed_idx", KEYED_INDEX),
                CreateIndexConcurrently("pgjobs_job_keyed_running_idx", KEYED_RUNNING_INDEX),
                ReplaceIndexConcurrently(
                    "pgjobs_job_claim_idx",
                    building="pgjobs_job_claim_new",
                    sql=CLAIM_INDEX,
                    reverse_sql=OLD_CLAIM_INDEX,
                    marker="limit_key IS NULL",  # pg_get_indexdef of the new one only
                ),
            ],
        ),
    ]
