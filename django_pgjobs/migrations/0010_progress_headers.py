"""A running job's reported progress, and the headers carried with a job from its enqueue.

Two nullable columns without a default: adding them changes only the catalog, not a row, so
the migration takes a moment on any table size. It takes an ACCESS EXCLUSIVE lock on
pgjobs_job for that moment, in short tries (django_pgjobs.migrating.BoundedLockWait).
"""

from django.db import migrations, models

from django_pgjobs.migrating import BoundedLockWait


class Migration(migrations.Migration):

    dependencies = [
        ('pgjobs', '0009_admin'),
    ]

    operations = [
        BoundedLockWait(
            migrations.AddField(
                model_name='job',
                name='progress',
                field=models.JSONField(blank=True, null=True),
            ),
            migrations.AddField(
                model_name='job',
                name='headers',
                field=models.JSONField(blank=True, null=True),
            ),
        ),
    ]
