"""Batches and dependencies (django_pgjobs.batch, after=), first step: the batch and dependency
tables, a job's batch, and the status `waiting`.

The job table is locked only briefly (BoundedLockWait): its new column has no default, and the
status checks are replaced unchecked (NOT VALID). 0017 checks them and builds the indexes
without locking writers out.
"""

import django.db.models.deletion
import django.db.models.functions.datetime
from django.db import migrations, models

import django_pgjobs.ids
from django_pgjobs.migrating import BoundedLockWait

STATUSES = "'ready', 'running', 'succeeded', 'failed', 'cancelled'"
CHECKS = """
    ALTER TABLE pgjobs_job
    DROP CONSTRAINT pgjobs_job_status_valid,
    ADD CONSTRAINT pgjobs_job_status_valid CHECK (status IN ({statuses})) NOT VALID,
    DROP CONSTRAINT pgjobs_job_finished_iff_finished_at,
    ADD CONSTRAINT pgjobs_job_finished_iff_finished_at CHECK (
        (finished_at IS NOT NULL AND status IN ('succeeded', 'failed', 'cancelled'))
        OR (finished_at IS NULL AND status IN ({live}))
    ) NOT VALID
"""
STATUS_CHOICES = [
    ('ready', 'ready'), ('running', 'running'), ('succeeded', 'succeeded'), ('failed', 'failed'),
    ('cancelled', 'cancelled'), ('waiting', 'waiting'),
]


class Migration(migrations.Migration):
    dependencies = [
        ('pgjobs', '0015_keyed_indexes'),
    ]

    operations = [
        migrations.CreateModel(
            name='Batch',
            fields=[
                ('id', models.UUIDField(default=django_pgjobs.ids.uuid7, editable=False, primary_key=True, serialize=False)),
                ('created_at', models.DateTimeField(db_default=django.db.models.functions.datetime.Now())),
                ('size', models.IntegerField()),
                ('on_complete', models.JSONField(blank=True, null=True)),
                ('on_success', models.JSONField(blank=True, null=True)),
                ('completed_at', models.DateTimeField(blank=True, null=True)),
                ('succeeded', models.IntegerField(blank=True, null=True)),
                ('failed', models.IntegerField(blank=True, null=True)),
                ('cancelled', models.IntegerField(blank=True, null=True)),
                ('succeeded_at', models.DateTimeField(blank=True, null=True)),
            ],
            options={
                'verbose_name': 'batch',
                'verbose_name_plural': 'batches',
                'indexes': [models.Index(condition=models.Q(('succeeded_at__isnull', True)), fields=['id'], name='pgjobs_batch_open_idx')],
            },
        ),
        migrations.CreateModel(
            name='Dependency',
            fields=[
                ('id', models.BigAutoField(primary_key=True, serialize=False)),
                ('failed', models.BooleanField(db_default=False, default=False)),
                ('after_batch', models.ForeignKey(db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='pgjobs.batch')),
                ('after_job', models.ForeignKey(db_constraint=False, db_index=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='pgjobs.job')),
                ('job', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='dependencies', to='pgjobs.job')),
            ],
            options={
                'verbose_name': 'dependency',
                'verbose_name_plural': 'dependencies',
                'indexes': [
                    models.Index(fields=['job'], name='pgjobs_dep_job_idx'),
                    models.Index(condition=models.Q(('after_job__isnull', False)), fields=['after_job'], name='pgjobs_dep_after_job_idx'),
                    models.Index(condition=models.Q(('after_batch__isnull', False)), fields=['after_batch'], name='pgjobs_dep_after_batch_idx'),
                    models.Index(condition=models.Q(('failed', True)), fields=['id'], name='pgjobs_dep_failed_idx'),
                ],
                'constraints': [models.CheckConstraint(condition=models.Q(('after_job__isnull', True), ('after_batch__isnull', True), _connector='XOR'), name='pgjobs_dep_one_target')],
            },
        ),
        BoundedLockWait(
            migrations.AddField(
                model_name='job',
                name='batch',
                field=models.ForeignKey(blank=True, db_constraint=False, db_index=False, editable=False, null=True, on_delete=django.db.models.deletion.DO_NOTHING, related_name='jobs', to='pgjobs.batch'),
            ),
            migrations.SeparateDatabaseAndState(
                state_operations=[
                    migrations.RemoveConstraint(model_name='job', name='pgjobs_job_status_valid'),
                    migrations.RemoveConstraint(model_name='job', name='pgjobs_job_finished_iff_finished_at'),
                    migrations.AlterField(
                        model_name='job',
                        name='status',
                        field=models.CharField(choices=STATUS_CHOICES, db_default='ready', max_length=10),
                    ),
                    migrations.AddConstraint(
                        model_name='job',
                        constraint=models.CheckConstraint(condition=models.Q(('status__in', ['ready', 'running', 'succeeded', 'failed', 'cancelled', 'waiting'])), name='pgjobs_job_status_valid'),
                    ),
                    migrations.AddConstraint(
                        model_name='job',
                        constraint=models.CheckConstraint(condition=models.Q(models.Q(('finished_at__isnull', False), ('status__in', ('succeeded', 'failed', 'cancelled'))), models.Q(('finished_at__isnull', True), ('status__in', ('ready', 'running', 'waiting'))), _connector='OR'), name='pgjobs_job_finished_iff_finished_at'),
                    ),
                ],
                database_operations=[
                    migrations.RunSQL(
                        CHECKS.format(statuses=f"{STATUSES}, 'waiting'", live="'ready', 'running', 'waiting'"),
                        reverse_sql=CHECKS.format(statuses=STATUSES, live="'ready', 'running'"),
                    ),
                ],
            ),
        ),
    ]
