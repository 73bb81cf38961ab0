"""What each worker's yielding to the application did, in its statistics (QueueStat rows).

New columns without a volatile default: no table rewrite. `yielded` has a default in the
database too, so that workers of the previous release keep writing their rows during a rolling
upgrade. The brief ACCESS EXCLUSIVE lock they
need waits for the workers' inserts at most a few seconds at a time (BoundedLockWait)."""

from django.db import migrations, models

from django_pgjobs.migrating import BoundedLockWait


class Migration(migrations.Migration):
    dependencies = [
        ('pgjobs', '0012_scheduled_indexes'),
    ]

    operations = [
        BoundedLockWait(
            migrations.AddField(
                model_name='queuestat',
                name='yielded',
                field=models.FloatField(db_default=0.0, default=0.0),
            ),
            migrations.AddField(
                model_name='queuestat',
                name='allowed',
                field=models.FloatField(blank=True, null=True),
            ),
            migrations.AddField(
                model_name='queuestat',
                name='open_ms',
                field=models.FloatField(blank=True, null=True),
            ),
            migrations.AddField(
                model_name='queuestat',
                name='baseline_ms',
                field=models.FloatField(blank=True, null=True),
            ),
            table="pgjobs_queuestat",
        ),
    ]
