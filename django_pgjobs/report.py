"""Public path of the health report, for code written before it moved into observability/.

The report lives in django_pgjobs.observability.report; this module only names it here, so that
`from django_pgjobs import report` (docs/reference/api.md) keeps working.
"""

from __future__ import annotations

from django_pgjobs.observability.report import Report, as_dict, collect

__all__ = ["Report", "as_dict", "collect"]
