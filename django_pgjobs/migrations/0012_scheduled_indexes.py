"""Scheduled jobs, second step: a ready job not yet due waits in an index of its own, by
run_at, out of the claim index, so that a claim reads only due jobs whatever the priorities of
the waiting ones.

Built without locking writers out (CREATE INDEX CONCURRENTLY, so the migration is not atomic):
workers and enqueues keep running while it builds. If it is interrupted, run migrate again: it
goes on from where it stopped (django_pgjobs.migrating). An earlier release built these indexes
in 0008; on a database where that 0008 ran whole, this migration finds them and keeps them.
"""

from django.db import migrations, models

from django_pgjobs.migrating import CreateIndexConcurrently, ReplaceIndexConcurrently

SCHEDULED_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_scheduled_idx" ON "pgjobs_job" ("run_at") '
    'INCLUDE ("queue") WHERE ("scheduled" AND "status" = \'ready\')'
)
CLAIM_INDEX = (
    'CREATE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" '
    '("queue", "priority" DESC, "run_at", "id") WHERE (NOT "scheduled" AND "status" = \'ready\')'
)
OLD_CLAIM_INDEX = (
    'CREATE INDEX CONCURRENTLY "{name}" ON "pgjobs_job" '
    '("queue", "priority" DESC, "run_at", "id") WHERE ("status" = \'ready\')'
)
# Jobs already waiting for their run_at move to the scheduled index, in batches, each
# committed (so the row locks are brief). Run again, it finds none or the few enqueued since.
MOVE_WAITING_JOBS = """
    DO $$
    DECLARE moved integer;
    BEGIN
        LOOP
            UPDATE pgjobs_job SET scheduled = true
            WHERE id IN (
                SELECT id FROM pgjobs_job
                WHERE status = 'ready' AND NOT scheduled AND run_at > now()
                LIMIT 10000 FOR UPDATE SKIP LOCKED
            );
            GET DIAGNOSTICS moved = ROW_COUNT;
            EXIT WHEN moved = 0;
            COMMIT;
        END LOOP;
    END $$
"""


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('pgjobs', '0011_room_for_heartbeats'),
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
                    index=models.Index(condition=models.Q(('scheduled', False), ('status', 'ready')), fields=['queue', '-priority', 'run_at', 'id'], name='pgjobs_job_claim_idx'),
                ),
                migrations.AddIndex(
                    model_name='job',
                    index=models.Index(condition=models.Q(('scheduled', True), ('status', 'ready')), fields=['run_at'], include=('queue',), name='pgjobs_job_scheduled_idx'),
                ),
            ],
            database_operations=[
                CreateIndexConcurrently("pgjobs_job_scheduled_idx", SCHEDULED_INDEX),
                migrations.RunSQL(MOVE_WAITING_JOBS, migrations.RunSQL.noop),
                ReplaceIndexConcurrently(
                    "pgjobs_job_claim_idx",
                    building="pgjobs_job_claim_new",
                    sql=CLAIM_INDEX,
                    reverse_sql=OLD_CLAIM_INDEX,
                    marker="NOT scheduled",  # pg_get_indexdef of the new one only
                ),
            ],
        ),
    ]
