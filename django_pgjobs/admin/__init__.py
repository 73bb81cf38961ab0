"""The admin: jobs and dead letters, batches, queues and their health report, periodic schedules.

Every ModelAdmin is registered here, and only here.
"""

from __future__ import annotations

from django.contrib import admin

from django_pgjobs.admin.batches import BatchAdmin
from django_pgjobs.admin.jobs import DeadLetterAdmin, JobAdmin
from django_pgjobs.admin.queues import QueueAdmin
from django_pgjobs.admin.schedules import ScheduleAdmin
from django_pgjobs.models import Batch, DeadLetter, Job, Queue, Schedule

admin.site.register(Job, JobAdmin)
admin.site.register(DeadLetter, DeadLetterAdmin)
admin.site.register(Batch, BatchAdmin)
admin.site.register(Queue, QueueAdmin)
admin.site.register(Schedule, ScheduleAdmin)
