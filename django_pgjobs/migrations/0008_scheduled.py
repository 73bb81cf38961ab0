"""Scheduled jobs, first step: the `scheduled` column. A ready job not yet due is scheduled, and
waits out of the claim index, in an index of its own (0012_scheduled_indexes builds both).

A column with a constant default: a catalog change, no table rewrite. Adding it takes an ACCESS
EXCLUSIVE lock on pgjobs_job for a moment, in short tries (django_pgjobs.migrating). IF NOT
EXISTS: an earlier release's 0008 added the column and built the indexes in one migration, and
one that stopped part-way left the column behind.
"""

from django.db import migrations, models

from django_pgjobs.migrating import BoundedLockWait


class Migration(migrations.Migration):

    dependencies = [
        ('pgjobs', '0007_claims'),
    ]

    operations = [
        BoundedLockWait(
            migrations.RunSQL(
                'ALTER TABLE "pgjobs_job" ADD COLUMN IF NOT EXISTS "scheduled" boolean '
                'DEFAULT false NOT NULL',
                'ALTER TABLE "pgjobs_job" DROP COLUMN "scheduled"',
                state_operations=[
                    migrations.AddField(
                        model_name='job',
                        name='scheduled',
                        field=models.BooleanField(db_default=False, default=False),
                    ),
                ],
            ),
        ),
    ]
