"""Storage for cheaper state changes: the unique-key index skips rows without a key, and pages
keep 30% free so a job's claim and its heartbeats fit on its own page.

Measured by the benchmark (docs/performance.md): at fillfactor 90 the claim's new row version
took the free space and only ~20% of first heartbeats were HOT; at 70, most are.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('pgjobs', '0003_deadletter'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='job',
            name='pgjobs_job_unique_key_live',
        ),
        migrations.AddConstraint(
            model_name='job',
            constraint=models.UniqueConstraint(condition=models.Q(('status__in', ('ready', 'running')), ('unique_key__isnull', False)), fields=('unique_key',), name='pgjobs_job_unique_key_live'),
        ),
        # Applies to pages written from now on; existing pages keep their fill.
        migrations.RunSQL(
            "ALTER TABLE pgjobs_job SET (fillfactor = 70)",
            "ALTER TABLE pgjobs_job SET (fillfactor = 90)",
        ),
    ]
