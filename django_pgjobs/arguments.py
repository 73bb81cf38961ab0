"""Whether a payload fits a handler's signature: one check for enqueue, the worker, the admin's
payload edit, periodic declarations and the Tasks backend, so that all of them say the same."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from django_pgjobs.errors import PayloadMismatch

#: Options of enqueue (and Celery's names for two) that a payload may hold by mistake.
OPTIONS = {
    **{
        name: name
        for name in ("queue", "priority", "run_at", "delay", "max_attempts", "unique_key")
    },
    "countdown": "delay",  # Celery's apply_async(countdown=...)
    "eta": "run_at",  # Celery's apply_async(eta=...)
}


def check_arguments(
    func: Callable[..., Any], name: str, args: Sequence[Any], kwargs: object
) -> None:
    """PayloadMismatch unless the handler can be called with `args` and `kwargs`, saying which
    arguments are unexpected or missing, and the handler's signature (as ``inspect.signature`` reads
    it; a callable without one, such as some builtins, is not checked)."""
    if not isinstance(kwargs, Mapping):
        raise PayloadMismatch(
            f"payload must be a JSON object of keyword arguments, got {type(kwargs).__name__}"
        )
    # A fit depends on the arguments' names, never their values: one found once is remembered.
    try:
        fit = (func, len(args), *kwargs)
        if fit in _FITS:
            return
    except TypeError:  # an unhashable callable: checked every time
        fit = None
    signature = _signature(func)
    if signature is None:
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as error:
        problems = _problems(signature, len(args), kwargs) or [str(error)]
        raise PayloadMismatch(
            f"the payload does not fit {name}{_shown(signature)}: {'; '.join(problems)}"
        ) from None
    if fit is not None and len(_FITS) < FITS_KEPT:
        _FITS.add(fit)


#: Calls found to fit: (handler, positional count, *keyword names). Bounded.
_FITS: set[tuple[Any, ...]] = set()
FITS_KEPT = 4096


def _problems(signature: inspect.Signature, given: int, kwargs: Mapping[str, Any]) -> list[str]:
    """What is wrong, argument by argument, for a call with `given` positional arguments (the
    Tasks backend's) and `kwargs`."""
    params = list(signature.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    filled = {p.name for p in positional[:given]}
    by_keyword = {
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in filled
    }
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    problems = []
    if given > len(positional) and not any(p.kind is p.VAR_POSITIONAL for p in params):
        problems.append(f"{given} positional arguments given, it takes {len(positional)}")
    for key in kwargs:
        if key in by_keyword or (takes_any and key not in filled):
            continue
        param = signature.parameters.get(key)
        if param is not None and param.kind is param.POSITIONAL_ONLY:
            problems.append(
                f"{key!r} is a positional-only argument, and a payload passes keyword arguments"
            )
        elif key in filled:
            problems.append(f"{key!r} is given twice, as a positional and a keyword argument")
        else:
            problems.append(f"unexpected argument {key!r}{_suggestion(key, by_keyword)}")
    for param in params:
        required = param.default is param.empty and param.kind not in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        )
        if required and param.name not in filled and param.name not in kwargs:
            if param.kind is param.POSITIONAL_ONLY:
                problems.append(
                    f"{param.name!r} is a required positional-only argument, which a payload "
                    "of keyword arguments cannot give"
                )
            else:
                problems.append(f"missing the required argument {param.name!r}")
    return problems


def _suggestion(key: str, names: set[str]) -> str:
    if key in OPTIONS:
        option = OPTIONS[key]
        return (
            f" ({key!r} looks like an enqueue option: pass {option}=... with "
            f"task.using({option}=...).enqueue(...) or Job.objects.enqueue(..., {option}=...))"
        )
    close = difflib.get_close_matches(key, sorted(names), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _shown(signature: inspect.Signature) -> str:
    """The signature without annotations: the names and defaults are what a payload must fit."""
    return str(
        signature.replace(
            parameters=[p.replace(annotation=p.empty) for p in signature.parameters.values()],
            return_annotation=inspect.Signature.empty,
        )
    )


def _signature(func: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return _cached_signature(func)
    except TypeError:  # an unhashable callable (e.g. a dataclass instance): not cached
        return _read_signature(func)


@lru_cache(maxsize=1024)
def _cached_signature(func: Callable[..., Any]) -> inspect.Signature | None:
    # Reading a signature costs more than running a small handler; functions don't change.
    return _read_signature(func)


def _read_signature(func: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(func)
    except (ValueError, TypeError):  # no signature to read (some builtins)
        return None
