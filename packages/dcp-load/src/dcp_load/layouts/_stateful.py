"""Stateful entries: objects with ``state_dict()`` and ``load_state_dict()`` in a state dict.

torch.distributed.checkpoint takes a state dict whose values may be such objects (its
``Stateful`` protocol: a module, an optimizer, a scheduler, torchtitan's model and optimizer
containers): ``save`` stores ``obj.state_dict()``, ``load`` fills ``obj.state_dict()`` and
then calls ``obj.load_state_dict`` with it. dcp does the same, at any depth of mappings and
lists (torch DCP looks at the top level only). Objects are called in sorted key order, depth
first (list items by index), whatever order each rank built its mappings in, as torch DCP's
``load`` sorts the top-level keys: a ``state_dict()`` or ``load_state_dict()`` that runs a
collective (a sharded optimizer's) then meets the same call on every rank instead of hanging.

* ``resolve`` calls ``state_dict()`` on every such object, before any plan, and returns the
  state dict with each object replaced by what it returned; mappings and lists on the way
  to an object are copied (the caller's containers are not changed), the rest is shared.
  A ``state_dict()`` that raises, or returns something other than a mapping, is an error
  naming the key and the object's type.
* ``hand_back`` runs once every value of this rank is filled and checked: non-tensor values
  replaced in a copied container are put into the caller's container too (as a load
  without objects replaces them), then each object's ``load_state_dict`` gets its filled
  state dict, in the order ``resolve`` called ``state_dict()``. A call that raises is an
  error naming the key and type; the objects before it are set, those after it are still
  set (each object is set whole or not at all, never half).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Resolved", "hand_back", "is_stateful", "resolve"]


def is_stateful(value: Any) -> bool:
    """torch DCP's ``Stateful``: ``state_dict`` and ``load_state_dict`` callables (a class
    itself is not one; neither is a tensor)."""
    if isinstance(value, type):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _type_name(value: Any) -> str:
    return f"{type(value).__module__}.{type(value).__qualname__}"


@dataclass
class Resolved:
    """The state dict to plan with, and how to hand its filled states back."""

    state: Any
    #: (key, object, the state dict it returned), in sorted key order (module docstring)
    objects: list[tuple[str, Any, Any]] = field(default_factory=list)
    #: (caller's container, its copy), for the non-tensor values a load replaces
    copies: list[tuple[Any, Any]] = field(default_factory=list)


def resolve(state_dict: Any, errors: list[str]) -> Resolved:
    """``state_dict`` with every Stateful replaced by its ``state_dict()``; problems go to
    ``errors`` (the object is then replaced by an empty mapping, so nothing of it loads)."""
    out = Resolved(state_dict)
    if isinstance(state_dict, Mapping):
        out.state = _resolve(state_dict, "", out, errors)
    return out


def _resolve(value: Any, path: str, out: Resolved, errors: list[str]) -> Any:
    if is_stateful(value) and not _is_tensor(value):
        return _state_of(value, path, out, errors)
    if isinstance(value, Mapping):
        done = {k: _resolve(value[k], f"{path}.{k}" if path else str(k), out, errors) for k in _sorted(value)}
        items = [(k, done[k]) for k in value]  # the copy keeps the caller's order
        if all(new is value[k] for k, new in items):
            return value
        copy = dict(items)
        out.copies.append((value, copy))
        return copy
    if isinstance(value, list):
        items = [_resolve(v, f"{path}.{i}", out, errors) for i, v in enumerate(value)]
        if all(new is old for new, old in zip(items, value, strict=True)):
            return value
        out.copies.append((value, items))
        return items
    return value


def _sorted(mapping: Mapping[Any, Any]) -> list[Any]:
    """The keys of ``mapping`` sorted as torch DCP sorts them; by their text where they do
    not compare (keys of several types), which every rank sorts alike too."""
    try:
        return sorted(mapping)
    except TypeError:
        return sorted(mapping, key=str)


def _state_of(obj: Any, path: str, out: Resolved, errors: list[str]) -> Any:
    try:
        state = obj.state_dict()
    except Exception as exc:  # noqa: BLE001 - named through the exchange, so that every rank raises
        errors.append(f"{path!r}: {_type_name(obj)}.state_dict() raised {type(exc).__name__}: {exc}")
        return {}
    if not isinstance(state, Mapping):
        errors.append(f"{path!r}: {_type_name(obj)}.state_dict() returned a {type(state).__qualname__}, not a "
                      "mapping; a Stateful's state_dict() must return a dict")
        return {}
    out.objects.append((path, obj, state))
    return state


def _is_tensor(value: Any) -> bool:
    from ._state import is_tensor

    return is_tensor(value)


def hand_back(resolved: Resolved, errors: list[str]) -> None:
    """After a load filled ``resolved.state`` (module docstring); problems go to ``errors``."""
    for original, copy in resolved.copies:
        if isinstance(original, MutableMapping):
            for key, value in copy.items():
                if key in original and value is not original[key] and not _is_own(value, resolved):
                    original[key] = value
        elif isinstance(original, list):
            for i, value in enumerate(copy):
                if value is not original[i] and not _is_own(value, resolved):
                    original[i] = value
    for path, obj, state in resolved.objects:
        try:
            obj.load_state_dict(state)
        except Exception as exc:  # noqa: BLE001 - named through the exchange, so that every rank raises
            errors.append(f"{path!r}: {_type_name(obj)}.load_state_dict() raised {type(exc).__name__}: {exc}")


def _is_own(value: Any, resolved: Resolved) -> bool:
    """Whether ``value`` is a container ``resolve`` made (a copy or an object's state):
    those stay out of the caller's containers, where the object (or the original) sits."""
    return any(value is c for _, c in resolved.copies) or any(value is s for _, _, s in resolved.objects)
