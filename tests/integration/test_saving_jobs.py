"""Job.save (models.py): a stored job is saved by the fields that changed, and a claimed job's
worker fields are its worker's alone."""

from __future__ import annotations

import pytest

from django_pgjobs.models import Job
from django_pgjobs.runtime.worker import Options, Worker
from django_pgjobs.status import Status
from tests.integration.test_worker import running


@pytest.mark.django_db(transaction=True)
def test_a_handler_saving_its_job_may_save_its_own_fields_not_its_workers():
    # current_job().save() wrote the claim-time lease (run out, perhaps), status and claim count
    # over the row: after a lost lease, over another worker's claim.
    worker, (job,) = running(1)
    job.payload = {"cursor": 7}
    job.save(update_fields=["payload"])  # a checkpoint: the handler's own field
    with pytest.raises(ValueError, match="save only the fields you changed"):
        job.save()
    with pytest.raises(ValueError, match="alone writes leased_until"):
        job.save(update_fields=["payload", "leased_until"])
    row = Job.objects.get(pk=job.pk)
    assert (row.payload, row.status, row.worker) == ({"cursor": 7}, Status.RUNNING, worker.id)
    Job.objects.get(pk=job.pk).save(update_fields=["priority"])  # one the worker does not hold


@pytest.mark.django_db(transaction=True)
def test_saving_a_stored_job_whole_is_refused_and_by_its_fields_rewinds_nothing():
    # `job.priority = 5; job.save()` on the Job enqueue returned, after a worker ran it: the
    # row was ready again with claims back at 0, and the job ran a second time.
    job = Job.objects.enqueue("tests.tasks.noop")
    worker = Worker(Options(queues=["default"], concurrency=1, listen=False, once=True))
    worker.run()
    job.priority = 5
    with pytest.raises(ValueError, match=r"job .* is stored: save only the fields you changed"):
        job.save()
    job.save(update_fields=["priority"])
    row = Job.objects.get(pk=job.pk)
    assert (row.status, row.claims, row.attempts, row.priority) == (Status.SUCCEEDED, 1, 1, 5)
    new = Job(task="tests.tasks.noop", queue="default", max_attempts=1)
    new.save()  # a new row saves whole, as any model's
    assert Job.objects.filter(pk=new.pk).exists()
    partial = Job.objects.only("priority").get(pk=job.pk)
    partial.priority = 7
    partial.save()  # Django saves the fields it loaded: none of the worker's
    assert Job.objects.values_list("priority", "status").get(pk=job.pk) == (7, Status.SUCCEEDED)
    with pytest.raises(ValueError, match="is stored"):
        Job.objects.only("priority", "status").get(pk=job.pk).save()
    copy = Job.objects.get(pk=job.pk)
    copy.pk = None
    copy.save()  # Django's way of copying a row: a new one
    assert Job.objects.count() == 3
