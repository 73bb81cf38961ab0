"""Scheduled jobs leave the claim index: a ready job not yet due waits in an index of its own, by
run_at, so that a claim reads only due jobs whatever the priorities of the waiting ones.

Built without locking the table (CREATE INDEX CONCURRENTLY, so the migration is not atomic):
workers and enqueues keep running while it builds. If it is interrupted, run migrate again; a
half-built index left INVALID is dropped and built again.
"""

from django.db import migrations, models

CLAIM_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_claim_new" ON "pgjobs_job" '
    '("queue", "priority" DESC, "run_at", "id") WHERE (NOT "scheduled" AND "status" = \'ready\')'
)
SCHEDULED_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_scheduled_idx" ON "pgjobs_job" ("run_at") '
    'INCLUDE ("queue") WHERE ("scheduled" AND "status" = \'ready\')'
)
OLD_CLAIM_INDEX = (
    'CREATE INDEX CONCURRENTLY "pgjobs_job_claim_idx" ON "pgjobs_job" '
    '("queue", "priority" DESC, "run_at", "id") WHERE ("status" = \'ready\')'
)


class Migration(migrations.Migration):
    atomic = False

    dependencies = [
        ('pgjobs', '0007_claims'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
            migrations.RemoveIndex(
                model_name='job',
                name='pgjobs_job_claim_idx',
            ),
            migrations.AddField(
                model_name='job',
                name='scheduled',
                field=models.BooleanField(db_default=False, default=False),
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
                # A column with a constant default: no table rewrite.
                migrations.RunSQL(
                    'ALTER TABLE "pgjobs_job" ADD COLUMN IF NOT EXISTS "scheduled" boolean '
                    'DEFAULT false NOT NULL',
                    'ALTER TABLE "pgjobs_job" DROP COLUMN "scheduled"',
                ),
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "pgjobs_job_scheduled_idx"',
                    migrations.RunSQL.noop,
                ),
                migrations.RunSQL(SCHEDULED_INDEX, 'DROP INDEX CONCURRENTLY "pgjobs_job_scheduled_idx"'),
                # Jobs already waiting for their run_at move to the new index, in batches.
                migrations.RunSQL(
                    """
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
                    """,
                    migrations.RunSQL.noop,
                ),
                migrations.RunSQL(
                    'DROP INDEX CONCURRENTLY IF EXISTS "pgjobs_job_claim_new"',
                    migrations.RunSQL.noop,
                ),
                migrations.RunSQL(CLAIM_INDEX, 'DROP INDEX CONCURRENTLY "pgjobs_job_claim_new"'),
                migrations.RunSQL(
                    # IF EXISTS: a run stopped after this step (and before the rename) finds it
                    # gone, and builds the new index again under its temporary name.
                    'DROP INDEX CONCURRENTLY IF EXISTS "pgjobs_job_claim_idx"',
                    OLD_CLAIM_INDEX,
                ),
                migrations.RunSQL(
                    'ALTER INDEX "pgjobs_job_claim_new" RENAME TO "pgjobs_job_claim_idx"',
                    'ALTER INDEX "pgjobs_job_claim_idx" RENAME TO "pgjobs_job_claim_new"',
                ),
            ],
        ),
    ]
