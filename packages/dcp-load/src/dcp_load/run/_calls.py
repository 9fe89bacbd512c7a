"""What each rank is calling now, so that a call that fails to pair names both calls.

Calls pair by their number per operation and group (``_coordinate.next_slot``); only calls
with collectives take a number. When the ranks still disagree (a rank came late, made a call
the others did not, or called without collectives while they called with them), the error
says what each side was doing: every call writes one record per rank,
``dcp-now/<group>/<rank>`` (its operation, number and checkpoint; one store write), and a
rank that gave up waiting reads the records of the ranks it names (on that error path only).

Records are control messages (``dcp_platform.codec``): another process can write the key,
so a record that does not decode is reported as unreadable, never trusted.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["describe_target", "latest_calls", "note_call", "others_moved_past", "with_calls"]

logger = logging.getLogger(__name__)

_KIND = "now"
_MAX_CHARS = 300  # a record is one line: operation, number, a path
_MAX_READS = 8  # records read on an error path, however many ranks are named


def _key(scope: str, rank: int) -> str:
    return f"dcp-now/{scope}/{rank}"


def describe_target(checkpoint_id: Any, storage_reader: Any = None) -> str:
    """The checkpoint a call names: its ``checkpoint_id``, else its reader's path or class."""
    if checkpoint_id is not None:
        return str(checkpoint_id)
    path = getattr(storage_reader, "path", None) or getattr(storage_reader, "checkpoint_id", None)
    return str(path) if path is not None else type(storage_reader).__name__


# This process's last collective call per group: (number, what it was), for ``before``.
_LAST: dict[str, tuple[int, str]] = {}
# The calls this process made without collectives since its last collective call, per group,
# and those it made before its current collective call (what ``others_moved_past`` reads).
_ALONE: dict[str, list[str]] = {}
_ALONE_BEFORE: dict[str, list[str]] = {}


def _record(what: str, slot: int | None, scope: str) -> dict[str, Any]:
    before = _LAST.get(scope)
    if slot is not None:
        _LAST[scope] = (slot, what[:_MAX_CHARS])
        _ALONE_BEFORE[scope] = _ALONE.pop(scope, [])
    else:
        _ALONE.setdefault(scope, []).append(_unnumbered(what[:_MAX_CHARS]))
        del _ALONE[scope][:-_MAX_READS]
    return {"what": what[:_MAX_CHARS], "slot": slot, "before": list(before) if before else None}


def note_call(store: Any, scope: str, rank: int, what: str, slot: int | None = None) -> None:
    """Record that ``rank`` of group ``scope`` is in the call ``what`` (number ``slot``; None:
    a call without collectives, which takes none) now: one store write."""
    from dcp_platform.codec import encode

    try:
        store.set(_key(scope, rank), encode(_KIND, _record(what, slot, scope)))
    except Exception as exc:  # noqa: BLE001 - only an error message would lack it
        logger.debug("could not record call %r of rank %d: %r", what, rank, exc)


def _read(store: Any, scope: str, rank: int) -> dict[str, Any] | str:
    """Rank ``rank``'s record, or why there is none (a store value is foreign input)."""
    from dcp_platform.codec import ControlMessageError, decode

    key = _key(scope, rank)
    try:
        if not store.check([key]):
            return "no call recorded"
        doc = decode(store.get(key), key=key, kind=_KIND)
    except ControlMessageError as exc:
        return f"unreadable record: {exc}"
    except Exception as exc:  # noqa: BLE001 - an error message is being built; the store may be gone
        return f"record not read: {type(exc).__name__}"
    return doc if _is_record(doc) else f"unreadable record at {key!r}: not a call record of this version"


def _is_record(doc: Any) -> bool:
    """``{"what": text, "slot": int or None, "before": None or [int, text]}``, texts as
    ``_record`` bounds them: anything else was not written by ``note_call``."""
    if not isinstance(doc, dict) or set(doc) != {"what", "slot", "before"}:
        return False
    what, slot, before = doc["what"], doc["slot"], doc["before"]
    if not isinstance(what, str) or len(what) > _MAX_CHARS or isinstance(slot, bool) or not isinstance(
            slot, int | None):
        return False
    return before is None or (isinstance(before, list) and len(before) == 2 and isinstance(before[0], int)
                              and not isinstance(before[0], bool) and isinstance(before[1], str)
                              and len(before[1]) <= _MAX_CHARS)


def latest_calls(store: Any, scope: str, ranks: Iterable[int]) -> dict[int, str]:
    """What each of ``ranks`` (at most ``_MAX_READS``) calls now, or why that is not known."""
    out: dict[int, str] = {}
    for rank in list(ranks)[:_MAX_READS]:
        doc = _read(store, scope, rank)
        out[rank] = doc if isinstance(doc, str) else doc["what"][:_MAX_CHARS]
    return out


def others_moved_past(store: Any, scope: str, other: int, slot: int, what: str) -> bool:
    """Whether rank ``other`` gave up call ``slot`` as a call other than ``what``, one this
    rank made without collectives since its last collective call, and is now in call
    ``slot + 1``, which is ``what``: this call is their next one. Otherwise (the same call,
    a call this rank did not make alone, or not known) this rank came late for call ``slot``."""
    doc = _read(store, scope, other)
    if isinstance(doc, str) or doc["slot"] != slot + 1 or not doc["before"] or doc["before"][0] != slot:
        return False
    what = what[:_MAX_CHARS]  # as records keep it
    gave_up = _unnumbered(doc["before"][1])
    return (_same(doc["what"], what) and gave_up != _unnumbered(what)
            and gave_up in _ALONE_BEFORE.get(scope, []))


def _same(a: str, b: str) -> bool:
    """Two calls' records name the same call but for its number ("load call 3 of X")."""
    return _unnumbered(a) == _unnumbered(b)


def _unnumbered(what: str) -> str:
    """``what`` without its call number or "without collectives" note: "load of X"."""
    what = what.split(" without collectives (")[0]
    head, sep, rest = what.partition(" call ")
    number, _, tail = rest.partition(" ")
    return f"{head} {tail}" if sep and number.isdigit() else what


def with_calls(failures: Mapping[int, Sequence[str]], me: int, this_call: str, store: Any, scope: str,
               world: int) -> dict[int, tuple[str, ...]]:
    """``failures`` of an arrival that did not complete, each cause that says a rank did not
    arrive followed by what that rank is calling now, and this rank's own call named."""
    missing = [r for r, causes in failures.items() if any("did not reach" in c for c in causes)]
    if not missing:
        return {r: tuple(c) for r, c in failures.items()}
    others = [r for r in range(world) if r not in missing and r != me][:1] if me in missing else []
    calls = latest_calls(store, scope, [*missing, *others])
    out = {r: tuple(c) for r, c in failures.items()}
    for r in missing:
        if r in calls and r != me:
            out[r] = (*out[r], f"its latest call: {calls[r]}; this rank's call: {this_call}")
    if me in missing:
        now = "; ".join(f"rank {r} is in: {calls[r]}" for r in others if r in calls)
        out[me] = (*out[me], f"this rank's {this_call} came after the other ranks gave up on it; it fails "
                   f"alone and this rank's next call pairs with theirs{'; ' + now if now else ''}")
    return out
