"""Public path of the health verdict, for code written before it moved into observability/.

The verdict lives in django_pgjobs.observability.health; this module only names it here, so that
`from django_pgjobs.health import Level` (docs/reference/api.md) keeps working.
"""

from __future__ import annotations

from django_pgjobs.observability.health import Level, Reason, Thresholds, Verdict, judge

__all__ = ["Level", "Reason", "Thresholds", "Verdict", "judge"]
