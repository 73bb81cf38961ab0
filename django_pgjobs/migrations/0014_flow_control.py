"""Flow control, first step: each job's limit key, a queue's rate limit, and the buckets of the
tasks' rate limits (django_pgjobs/limits.py).

New columns without a default: no table rewrite. The brief ACCESS EXCLUSIVE locks they need wait
for enqueues and claims at most a few seconds at a time (BoundedLockWait). The indexes follow in
0015, built concurrently."""

from django.db import migrations, models

import django_pgjobs.limits
from django_pgjobs.migrating import BoundedLockWait


class Migration(migrations.Migration):
    dependencies = [
        ('pgjobs', '0013_queuestat_yielding'),
    ]

    operations = [
        migrations.CreateModel(
            name='Bucket',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('task', models.CharField(max_length=200)),
                ('key', models.CharField(max_length=200)),
                ('full_at', models.DateTimeField()),
            ],
            options={
                'constraints': [models.UniqueConstraint(fields=('task', 'key'), name='pgjobs_bucket_task_key')],
            },
        ),
        BoundedLockWait(
            migrations.AddField(
                model_name='job',
                name='limit_key',
                field=models.CharField(blank=True, editable=False, max_length=200, null=True),
            ),
        ),
        BoundedLockWait(
            migrations.AddField(
                model_name='queue',
                name='full_at',
                field=models.DateTimeField(blank=True, editable=False, null=True),
            ),
            migrations.AddField(
                model_name='queue',
                name='rate_limit',
                field=models.CharField(blank=True, help_text='Most jobs of this queue started per second, minute or hour, by all workers together, as "10/s", "100/m" or "1000/h"; empty for no limit.', max_length=20, null=True, validators=[django_pgjobs.limits.validate_rate]),
            ),
            table="pgjobs_queue",
        ),
    ]
