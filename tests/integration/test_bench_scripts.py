"""The benchmark's pgbench ceiling must run the claim with the plan the worker gets: a ceiling
measured with a worse plan makes every ratio to it flatter (the claim index's predicate gained
`NOT scheduled` in migration 0008, and the ceiling's script went on sorting the whole table)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import plans
from tests.factories import backlog

pytestmark = pytest.mark.django_db

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "claim_complete.sql"


def test_the_ceilings_claim_reads_the_claim_index_like_the_workers():
    backlog({"default": 2_000}, finished=20_000)
    claim = re.search(
        r"SELECT id FROM pgjobs_job.*?FOR UPDATE SKIP LOCKED", SCRIPT.read_text(), re.S
    )
    assert claim is not None
    plan = plans.explain(claim.group(0).replace(":batch", "100"))
    assert plans.index_scans(plan, "pgjobs_job_claim_idx"), plans.shown(plan)
    assert not plans.of_type(plan, "Sort"), plans.shown(plan)
