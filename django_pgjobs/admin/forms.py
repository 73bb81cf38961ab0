"""The options a bulk action asks for on its confirmation page (actions.py shows them)."""

from __future__ import annotations

from typing import Any

from django import forms
from django.core.exceptions import ValidationError
from django.db import DatabaseError, transaction
from django.utils.html import format_html, format_html_join
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy

from django_pgjobs.errors import EnqueueError
from django_pgjobs.observability import stats
from django_pgjobs.validation import check_queue


class ActionForm(forms.Form):
    """The options an action asks for on its confirmation page: `options()` become the
    transition's keyword arguments."""

    def options(self) -> dict[str, Any]:
        return dict(self.cleaned_data)

    def change_message(self, default: str) -> str:
        """The admin log's message for the rows changed with these options."""
        return default


class ReplayForm(ActionForm):
    """Replay's option, the queue to replay into; a queue no live worker serves (a typo, most
    likely) is refused once, with the queues that are served, then taken as confirmed."""

    queue = forms.CharField(
        label=gettext_lazy("Into queue"),
        required=False,
        max_length=100,
        widget=forms.TextInput(attrs={"list": "pgjobs-served-queues", "autocomplete": "off"}),
    )
    # The queue the user replays into although no live worker serves it, asked once.
    unserved = forms.CharField(required=False, widget=forms.HiddenInput)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:  # a hint only: a statistics row it cannot read must not cost the replay
            with transaction.atomic():
                self.served = sorted(stats.served_queues(stats.worker_stats()))
        except DatabaseError:
            self.served = []
        help_text = _("Leave empty to replay each job into its own queue.")
        if self.served:
            served = format_html_join(", ", "<code>{}</code>", ((q,) for q in self.served))
            help_text = format_html("{} {} {}.", help_text, _("Live workers serve:"), served)
        else:
            help_text = format_html("{} {}", help_text, _("No live worker seen right now."))
        self.fields["queue"].help_text = help_text

    def clean_queue(self) -> str | None:
        queue: str = self.cleaned_data["queue"].strip()
        try:
            return check_queue(queue) if queue else None
        except EnqueueError as error:
            raise ValidationError(str(error)) from None

    def clean(self) -> dict[str, Any]:
        cleaned = super().clean() or {}
        queue = cleaned.get("queue")
        # With no live worker at all there is nothing to compare with (the report says so).
        if queue and self.served and queue not in self.served and cleaned.get("unserved") != queue:
            # Pressed again, the replay goes ahead. (One value per key: POST is a QueryDict.)
            self.data = {**{key: self.data.get(key) for key in self.data}, "unserved": queue}
            raise ValidationError(
                _(
                    "No live worker serves the queue “%(queue)s”: its jobs would wait until one "
                    "does. Live workers serve: %(served)s. Press “Yes, I’m sure” again to replay "
                    "into “%(queue)s” anyway."
                ),
                params={"queue": queue, "served": ", ".join(self.served)},
            )
        return cleaned

    def options(self) -> dict[str, Any]:
        return {"queue": self.cleaned_data["queue"]}

    def change_message(self, default: str) -> str:
        queue = self.cleaned_data["queue"]
        return _("Replayed into queue %s.") % queue if queue else default
