"""The workers' statistics rolled up by minute and hour (Rollup) and each worker's last report
(Worker), kept by a trigger on the QueueStat rows: the report reads a few hundred rows, not every
row every worker wrote. The statistics already kept are rolled up here; workers' reports wait for
that (seconds at a few hundred thousand rows), then go on.
"""

from django.db import migrations, models

import django_pgjobs.models

from django_pgjobs.migrating import BoundedLockWait

# Each statement's rows added up per key, then upserted in one order for every session: two
# workers' reports upsert the same rows and must not deadlock. Rows of `seconds = 0` (a worker's
# goodbye) cover nothing: they only say the worker stopped. A row whose seconds are not a finite
# number (by hand, from a restored dump) is left out: `'NaN' < 'Infinity'` is false.
#: Positions in a histogram: LATENCY_BUCKETS' and DURATION_BUCKETS' bounds, and one for the rest.
POSITIONS = 16
# Each position summed on its own (a histogram is a short JSON array): no row per element.
SUMS = ", ".join(f"COALESCE(sum((counts->>{n})::bigint), 0)" for n in range(POSITIONS))
ROLL_UP_ROWS = """
    INSERT INTO pgjobs_rollup AS r (
        kind, step, at, name, since, claimed, succeeded, retried, failed, allowed, latency,
        durations
    )
    SELECT kind, step, to_timestamp(floor(extract(epoch FROM at) / step) * step) AS slot, name,
           min(at - make_interval(secs => seconds)), sum(claimed), sum(succeeded), sum(retried),
           sum(failed), sum(allowed * seconds),
           CASE WHEN kind = 'queue' THEN ARRAY[{sums}] ELSE '{}' END,
           CASE WHEN kind = 'task' THEN ARRAY[{sums}] ELSE '{}' END
    FROM (  -- each row under its queue, and under each task it ran
        SELECT 'queue' AS kind, queue AS name, at, seconds, claimed, succeeded, retried, failed,
               allowed, latency_buckets AS counts
        FROM {rows} AS added WHERE seconds > 0 AND seconds < 'Infinity'
        UNION ALL
        SELECT 'task', t.key, at, seconds, 0, (t.value->>'succeeded')::bigint,
               (t.value->>'retried')::bigint, (t.value->>'failed')::bigint, NULL,
               t.value->'durations'
        FROM {rows} AS added CROSS JOIN jsonb_each(added.tasks) AS t
        WHERE seconds > 0 AND seconds < 'Infinity'
    ) AS reported CROSS JOIN (VALUES (60), (3600)) AS steps (step)
    GROUP BY kind, step, slot, name
    ORDER BY kind, step, slot, name
    ON CONFLICT (kind, step, at, name) DO UPDATE SET
        since = least(r.since, EXCLUDED.since),
        claimed = r.claimed + EXCLUDED.claimed,
        succeeded = r.succeeded + EXCLUDED.succeeded,
        retried = r.retried + EXCLUDED.retried,
        failed = r.failed + EXCLUDED.failed,
        allowed = COALESCE(r.allowed + EXCLUDED.allowed, r.allowed, EXCLUDED.allowed),
        latency = pgjobs_add_buckets(r.latency, EXCLUDED.latency),
        durations = pgjobs_add_buckets(r.durations, EXCLUDED.durations);

    INSERT INTO pgjobs_worker AS w (name, seen_at, seconds, queues, stopped, yielding)
    SELECT worker, max(at), max(seconds), array_agg(DISTINCT queue ORDER BY queue),
           bool_or(seconds = 0),
           jsonb_object_agg(queue, jsonb_build_object(
               'seconds', seconds, 'yielded', yielded, 'allowed', allowed, 'claimed', claimed,
               'open_ms', open_ms, 'baseline_ms', baseline_ms
           )) FILTER (WHERE seconds > 0)
    FROM {rows} AS added WHERE seconds >= 0 AND seconds < 'Infinity'
    GROUP BY worker ORDER BY worker
    ON CONFLICT (name) DO UPDATE SET
        seen_at = greatest(w.seen_at, EXCLUDED.seen_at),
        seconds = CASE WHEN EXCLUDED.seen_at >= w.seen_at AND EXCLUDED.seconds > 0
                       THEN EXCLUDED.seconds ELSE w.seconds END,
        queues = ARRAY(SELECT DISTINCT unnest(w.queues || EXCLUDED.queues) ORDER BY 1),
        stopped = w.stopped OR EXCLUDED.stopped,
        yielding = CASE WHEN EXCLUDED.seen_at >= w.seen_at
                        THEN COALESCE(w.yielding || EXCLUDED.yielding, w.yielding, EXCLUDED.yielding)
                        ELSE COALESCE(EXCLUDED.yielding || w.yielding, w.yielding, EXCLUDED.yielding)
                   END;
"""
ROLL_UP = """
-- Every report updates the rows of its minute and hour: room on their pages keeps the updates
-- HOT (no new index entries), as for the job table.
ALTER TABLE pgjobs_rollup SET (fillfactor = 50);
ALTER TABLE pgjobs_worker SET (fillfactor = 50);

-- A row's histogram plus a statement's (an upsert).
CREATE FUNCTION pgjobs_add_buckets(a bigint[], b bigint[]) RETURNS bigint[]
    IMMUTABLE PARALLEL SAFE LANGUAGE sql
    AS $$ SELECT ARRAY(SELECT COALESCE(x, 0) + COALESCE(y, 0) FROM unnest(a, b) AS t(x, y)) $$;

-- As the tables' owner: a workers' role granted table by table needs nothing more to report.
CREATE FUNCTION pgjobs_roll_up() RETURNS trigger LANGUAGE plpgsql
    SECURITY DEFINER SET search_path FROM CURRENT AS $$
BEGIN
{roll_up}    RETURN NULL;
END
$$;

CREATE TRIGGER pgjobs_queuestat_roll_up AFTER INSERT ON pgjobs_queuestat
    REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION pgjobs_roll_up();

-- The statistics kept so far, rolled up as if just written: no insert slips in meanwhile, as
-- the trigger's creation holds a lock that inserts wait for.
{backfill}
"""
ROLL_UP_ROWS = ROLL_UP_ROWS.replace("{sums}", SUMS)
ROLL_UP = ROLL_UP.replace("{roll_up}", ROLL_UP_ROWS.replace("{rows}", "added")).replace(
    "{backfill}", ROLL_UP_ROWS.replace("{rows}", "pgjobs_queuestat")
)
NO_ROLL_UP = """
DROP TRIGGER pgjobs_queuestat_roll_up ON pgjobs_queuestat;
DROP FUNCTION pgjobs_roll_up();
DROP FUNCTION pgjobs_add_buckets(bigint[], bigint[]);
"""


class Migration(migrations.Migration):

    dependencies = [
        ('pgjobs', '0017_batch_indexes'),
    ]

    operations = [
        migrations.CreateModel(
            name='Rollup',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('kind', models.CharField(max_length=5)),
                ('name', models.CharField(max_length=200)),
                ('step', models.IntegerField()),
                ('at', models.DateTimeField()),
                ('since', models.DateTimeField()),
                ('claimed', models.BigIntegerField(default=0)),
                ('succeeded', models.BigIntegerField(default=0)),
                ('retried', models.BigIntegerField(default=0)),
                ('failed', models.BigIntegerField(default=0)),
                ('allowed', models.FloatField(blank=True, null=True)),
                ('latency', django_pgjobs.models.Counts(default=list)),
                ('durations', django_pgjobs.models.Counts(default=list)),
            ],
            options={
                'verbose_name': 'rollup',
                'verbose_name_plural': 'rollups',
                'constraints': [models.UniqueConstraint(fields=('kind', 'step', 'at', 'name'), name='pgjobs_rollup_unique')],
            },
        ),
        migrations.CreateModel(
            name='Worker',
            fields=[
                ('name', models.CharField(max_length=200, primary_key=True, serialize=False)),
                ('seen_at', models.DateTimeField()),
                ('seconds', models.FloatField()),
                ('queues', django_pgjobs.models.Names(default=list)),
                ('stopped', models.BooleanField(default=False)),
                ('yielding', models.JSONField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'worker',
                'verbose_name_plural': 'workers',
                'indexes': [models.Index(fields=['seen_at'], name='pgjobs_worker_seen_idx')],
            },
        ),
        # Workers' reports wait for the column, the trigger and the backfill; the lock is waited
        # for at most briefly at a time, so that reports and the report's reads go on meanwhile.
        BoundedLockWait(
            migrations.AddField(
                model_name='queuestat',
                name='tasks',
                field=models.JSONField(blank=True, null=True),
            ),
            migrations.RunSQL(ROLL_UP, reverse_sql=NO_ROLL_UP),
            table="pgjobs_queuestat",
        ),
    ]
