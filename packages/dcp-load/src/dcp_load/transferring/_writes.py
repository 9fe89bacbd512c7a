"""How one ``transfer`` writes this rank's destinations, and what a failure leaves in them.

Known once the plan is: in place as the pieces arrive, or staged (``atomic=True``, or a
``delta=True`` call after its plan's first) and written only after every rank succeeded. A
call that writes in place notes, round by round, the destinations a round writes before the
round starts (``_move.move``): when the call fails, those are torn (``_versions.tear``, and
``LoadError.torn``) and every other destination of this rank still holds what it held. A
round writes a destination when it copies a piece of this rank's own ``src`` into it or
receives a piece into it (or into staging copied into it after the round), so a destination
whose pieces come in a later round than the failure is not torn.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .._errors import LoadError
from . import _versions

__all__ = ["Writes"]

#: What a failed call that writes in place says on every rank (its destinations named after it).
IN_PLACE = ("transfer: the destinations may hold a mix of two steps (pieces written before the failure hold the "
            "new values, the others the previous ones); this call's plan was forgotten, so the next transfer plans "
            "again and sends everything (with delta=True too)")

#: What a failed staged call says.
STAGED = ("transfer({how}): no destination was written (the pieces were staged, to be written only after every "
          "rank succeeded): every destination holds the previous transfer's values and version; this call's plan "
          "was forgotten, so the next transfer plans again and sends everything")


class Writes:
    """This call's way of writing (``atomic``: the caller's; ``staged``: decided with the plan)
    and, while it writes in place, the destinations written so far (``torn``)."""

    def __init__(self, atomic: bool):
        self.atomic = atomic
        self.known = self.staged = self.done = False
        self.how = "atomic=True"
        self.torn: set[str] = set()  # destinations a round that writes them in place has started on
        self.spans: dict[str, Any] = {}  # this rank's destinations' bytes (``_ledger.spans``)

    def decide(self, delta: Any, spans: dict[str, Any]) -> None:
        """The plan is known: staged when ``atomic`` or a delta plan committed a call already."""
        self.known, self.spans = True, spans
        self.staged = self.atomic or (delta is not None and delta.committed)
        if not self.atomic:
            self.how = "delta=True"

    def finished(self) -> None:
        """Every rank agreed and this rank's writes are made: nothing to tear from here on."""
        self.done = True
        self.torn.clear()

    def _advice(self) -> str:
        if self.staged and not self.torn:
            return STAGED.format(how=self.how)
        names = sorted(self.torn)
        if not self.spans:
            mine = "This rank has no destinations."
        elif not names:
            mine = "No destination of this rank was written: each holds its previous version whole."
        else:
            shown = ", ".join(repr(n) for n in names[:20]) + (f" ... and {len(names) - 20} more" if len(names) > 20
                                                              else "")
            mine = (f"Torn on this rank ({len(names)} of {len(self.spans)} destinations, LoadError.torn; "
                    f"synced_version reads None for them until a transfer fills them again): {shown}; the other "
                    "destinations of this rank hold their previous version whole.")
        return f"{IN_PLACE}. {mine}"

    @contextlib.contextmanager
    def noted(self) -> Iterator[None]:
        """Around the call: a failure once the plan is known tears the destinations written
        and says what the destinations hold (in place of the line written for ``load``)."""
        try:
            yield
        except BaseException as exc:
            if self.known and not self.done:
                _versions.tear(self.spans[n] for n in self.torn if n in self.spans)
                if isinstance(exc, LoadError) and exc.phase != "validate":
                    exc.torn = tuple(sorted(self.torn))
                    exc.advise(self._advice())
            raise
