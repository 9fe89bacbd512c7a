"""``--sources FILE``: the ``sources=`` mapping of ``load`` read from a JSON or Python file,
and the output tensors it composes (their names, shapes and dtypes) for ``convert``.

JSON form: ``{"dest": "saved name"}`` renames; ``{"concat": [parts], "dim": d, "groups":
g}``, ``{"stack": [parts], "dim": d}`` and ``{"slice": "saved name", "dim": d, "start": a,
"stop": b}`` compose (a part is a name or a slice object). A Python file defines a variable
``sources`` holding the mapping (``dcp_load.Concat`` and friends). ``{name}`` placeholders
in a destination stand for one dot-free segment, bound by the saved names of its first
source.
"""

from __future__ import annotations

import json
import os
import re
import runpy
from collections.abc import Mapping
from typing import Any

from ..layouts._sources import Concat, Slice, Stack

__all__ = ["composed_tensors", "load_sources_file", "sources_from_json"]


def _part(value: Any, where: str) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and "slice" in value:
        try:
            return Slice(value["slice"], int(value["dim"]), int(value["start"]), int(value["stop"]))
        except KeyError as exc:
            raise ValueError(f"sources {where}: a slice needs 'slice', 'dim', 'start' and 'stop', missing "
                             f"{exc}") from None
    raise ValueError(f"sources {where}: a part must be a saved name or a {{'slice': ...}} object, got {value!r:.80}")


def _source(value: Any, where: str) -> Any:
    if isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise ValueError(f"sources {where}: expected a name or a concat/stack/slice object, got {value!r:.80}")
    if "concat" in value:
        return Concat([_part(p, where) for p in value["concat"]], dim=int(value.get("dim", 0)),
                      groups=int(value.get("groups", 1)))
    if "stack" in value:
        return Stack([_part(p, where) for p in value["stack"]], dim=int(value.get("dim", 0)))
    if "slice" in value:
        return _part(value, where)
    raise ValueError(f"sources {where}: an object needs one of 'concat', 'stack' or 'slice', got keys "
                     f"{sorted(value)}")


def sources_from_json(doc: Any, path: str = "<json>") -> dict[str, Any]:
    if not isinstance(doc, Mapping) or not all(isinstance(k, str) for k in doc):
        raise ValueError(f"{path}: the sources must be a JSON object {{destination: source}}")
    return {k: _source(v, f"{path}: {k!r}") for k, v in doc.items()}


def load_sources_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping in ``path``: a ``.py`` file's ``sources`` variable, else JSON."""
    path = os.fspath(path)
    if path.endswith(".py"):
        # runs the file: it is the user's own configuration, as a Python config file is
        namespace = runpy.run_path(path)
        if not isinstance(namespace.get("sources"), Mapping):
            raise ValueError(f"{path} must define a variable 'sources' holding a mapping {{destination: source}}, "
                             f"got {type(namespace.get('sources')).__name__}")
        return dict(namespace["sources"])
    with open(path, encoding="utf-8") as f:
        try:
            doc = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not JSON ({exc}); write the sources as JSON or as a .py file defining "
                             "'sources'") from None
    return sources_from_json(doc, path)


# -- geometry ---------------------------------------------------------------------------------
def _names(src: Any) -> list[str]:
    """The saved-name patterns ``src`` reads, in order."""
    if isinstance(src, str):
        return [src]
    if hasattr(src, "parts"):
        return [n for p in src.parts for n in _names(p)]
    return _names(src.source)


def _pattern(text: str) -> re.Pattern[str]:
    out, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}", text):
        out.append(re.escape(text[pos:m.start()]))
        out.append(f"(?P<{m.group(1)}>[^.]+)")
        pos = m.end()
    out.append(re.escape(text[pos:]))
    return re.compile("".join(out) + r"\Z")


def _shape(meta: Any, src: Any, bind: Mapping[str, str], dest: str) -> tuple[tuple[int, ...], str]:
    if isinstance(src, str):
        name = src.format(**bind)
        t = meta.tensors.get(name)
        if t is None:
            raise ValueError(f"sources {dest!r}: the checkpoint has no tensor {name!r}")
        return tuple(t.shape), t.dtype
    if hasattr(src, "parts"):
        shapes = [_shape(meta, p, bind, dest) for p in src.parts]
        dim = src.dim
        if not hasattr(src, "groups"):  # Stack
            first = shapes[0][0]
            return (*first[:dim], len(shapes), *first[dim:]), shapes[0][1]
        first = list(shapes[0][0])
        first[dim] = sum(s[dim] for s, _ in shapes)
        return tuple(first), shapes[0][1]
    shape, dtype = _shape(meta, src.source, bind, dest)
    out = list(shape)
    out[src.dim] = src.stop - src.start
    return tuple(out), dtype


def composed_tensors(meta: Any, sources: Mapping[str, Any]
                     ) -> tuple[dict[str, tuple[tuple[int, ...], str]], set[str], dict[str, str]]:
    """({destination name: (shape, dtype)}, saved names the sources read, {destination:
    saved name} of the renames). A destination's placeholders are bound by every saved name
    its first source matches; a tensor the sources read is not also written under its own
    name."""
    composed: dict[str, tuple[tuple[int, ...], str]] = {}
    consumed: set[str] = set()
    renames: dict[str, str] = {}
    saved = sorted(meta.tensors)
    for dest, src in sources.items():
        names = _names(src)
        first = _pattern(names[0])
        binds = [m.groupdict() for n in saved if (m := first.match(n))]
        if not binds:
            raise ValueError(f"sources {dest!r}: no saved tensor matches {names[0]!r}")
        for bind in binds:
            try:
                name = dest.format(**bind)
            except KeyError as exc:
                raise ValueError(f"sources {dest!r}: placeholder {exc} is not in its first source "
                                 f"{names[0]!r}") from None
            composed[name] = _shape(meta, src, bind, dest)
            consumed.update(n.format(**bind) for n in names)
            if isinstance(src, str):
                renames[name] = src.format(**bind)
    return composed, consumed, renames
