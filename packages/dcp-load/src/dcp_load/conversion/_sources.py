"""What ``convert`` writes and where each output comes from: the checkpoint seen through
``prefix=`` (select and rename by name prefix), then through ``sources=``, which is
``load``'s own ``SourceMap`` and ``compose`` (``layouts/_sources.py``): every mapping is
checked once, as ``load`` checks it, before any output file exists. And ``--sources FILE``:
the mapping read from a JSON or Python file.

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
import runpy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..layouts._keys import missing_advice
from ..layouts._sources import (
    Concat,
    Slice,
    SourceError,
    SourceMap,
    Stack,
    compose,
    describe,
    leaves,
    map_leaves,
)

__all__ = ["Outputs", "load_sources_file", "map_outputs", "prefix_map", "sources_from_json"]


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


#: Mapping problems listed in full in one error (a generated mapping can give thousands).
_SHOWN = 10


# -- the outputs --------------------------------------------------------------------------
@dataclass(frozen=True)
class Outputs:
    """``tensors``: {output name: (shape, dtype of its saved bytes)}; ``reads``: {output
    name: its source over the checkpoint's saved names} for each output not read under its
    own name (renamed by ``prefix=`` or mapped by ``sources=``); ``values``: {output name:
    saved name} of the non-tensor values."""

    tensors: dict[str, tuple[tuple[int, ...], str]]
    reads: dict[str, Any]
    values: dict[str, str]


def prefix_map(prefix: Any) -> dict[str, str] | None:
    """``prefix=`` as {saved prefix: output prefix}: a str ``p`` is ``{p: ""}`` (keep the
    names under ``p``, without it); None keeps every name as saved."""
    if prefix is None:
        return None
    if isinstance(prefix, str):
        prefix = {prefix: ""}
    if not isinstance(prefix, Mapping) or not prefix:
        raise TypeError(f"convert: prefix must be a str or a non-empty mapping {{saved prefix: output prefix}}, "
                        f"got {prefix!r:.80}")
    bad = [(k, v) for k, v in prefix.items() if not isinstance(k, str) or not k or not isinstance(v, str)]
    if bad:
        raise TypeError(f"convert: prefix maps non-empty str saved prefixes to str output prefixes, got "
                        f"{', '.join(f'{k!r}: {v!r}' for k, v in bad[:3])}")
    return dict(prefix)


def _view(names: Sequence[str], prefix: Mapping[str, str] | None, used: set[str], errors: list[str]
          ) -> dict[str, str]:
    """{name seen: saved name} of ``names`` under ``prefix`` (the longest saved prefix that
    a name starts with is replaced; names under none are left out)."""
    if prefix is None:
        return {n: n for n in names}
    out: dict[str, str] = {}
    longest = sorted(prefix, key=len, reverse=True)
    for name in names:
        old = next((p for p in longest if name.startswith(p)), None)
        if old is None:
            continue
        used.add(old)
        new = prefix[old] + name[len(old):]
        if not new:
            errors.append(f"convert: prefix={{{old!r}: {prefix[old]!r}}} turns {name!r} into an empty name")
        elif new in out:
            errors.append(f"convert: prefix= gives {new!r} to both {out[new]!r} and {name!r}; make the output "
                          "prefixes distinct")
        else:
            out[new] = name
    return out


def map_outputs(meta: Any, sources: Any, prefix: Any) -> Outputs:
    """The outputs of ``meta`` (a checkpoint's metadata) through ``prefix`` and ``sources``.
    ValueError (or TypeError) listing every mistake: a prefix no name has, two names
    renamed alike, every ``sources=`` refusal of ``load``, and an entry that composes
    nothing from the checkpoint."""
    errors: list[str] = []
    prefix, used = prefix_map(prefix), set()
    seen = _view(sorted(meta.tensors), prefix, used, errors)
    values = _view(sorted(meta.values), prefix, used, errors)
    for p in [p for p in prefix or () if p not in used]:
        errors.append(f"convert: prefix {p!r} starts no tensor or value name of the checkpoint; "
                      f"{missing_advice([p], [*meta.tensors, *meta.values]) or 'check the prefix'}")
    view = {n: meta.tensors[s] for n, s in seen.items()}
    composed = _composed(view, sources, errors) if sources else {}
    if errors:
        more = f"\n  ... and {len(errors) - _SHOWN} more" if len(errors) > _SHOWN else ""
        raise ValueError(f"{len(errors)} problem(s) with the mapping, nothing was written:\n  " +
                         "\n  ".join(errors[:_SHOWN]) + more)
    consumed = {n for _, _, src in composed.values() for n in leaves(src)}
    tensors = {n: (tuple(t.shape), t.dtype) for n, t in view.items() if n not in consumed and n not in composed}
    reads: dict[str, Any] = {n: seen[n] for n in tensors if seen[n] != n}
    for dest, (shape, dtype, src) in composed.items():
        tensors[dest] = (shape, dtype)
        reads[dest] = map_leaves(src, seen.__getitem__)
    clash = sorted(set(tensors) & set(values))
    if clash:
        raise ValueError(f"convert: {', '.join(repr(n) for n in clash[:5])} would name both a tensor and a value "
                         "of the output; rename one with sources= or prefix=")
    return Outputs(dict(sorted(tensors.items())), reads, values)


def _composed(view: Mapping[str, Any], sources: Mapping[str, Any], errors: list[str]
              ) -> dict[str, tuple[tuple[int, ...], str, Any]]:
    """{destination: (shape, dtype, source over ``view``'s names)} of every destination the
    entries compose from ``view`` (``SourceMap.enumerate``, as ``load`` builds its virtual
    tensors), each matched back (two entries matching one is refused) and composed."""
    source_map = SourceMap(sources, owner="convert")  # TypeError/ValueError: as load refuses it
    out: dict[str, tuple[tuple[int, ...], str, Any]] = {}
    produced: set[str] = set()
    for dest in source_map.enumerate(view):
        try:
            key, src = source_map.match(dest)
        except ValueError as exc:
            errors.append(str(exc))
            continue
        produced.add(key)
        where = f"convert: destination {dest!r} (sources[{key!r}])"
        try:
            shape, dtypes, _ = compose(src, view, where)
        except SourceError as exc:
            errors.append(str(exc.args[0]))
            continue
        kinds = {d.startswith("complex") for d in dtypes}
        if len(kinds) > 1:
            errors.append(f"{where}: {describe(src)} mixes complex and real parts ({', '.join(dtypes)}); "
                          "complex and real do not mix")
            continue
        out[dest] = (tuple(shape), dtypes[0], src)
    errors.extend(_nothing(key, src, view) for key, _, _, src in source_map.entries if key not in produced)
    return out


def _nothing(key: str, source: Any, view: Mapping[str, Any]) -> str:
    """Why the entry ``key`` composes no destination: the source names no saved tensor
    matches, with the nearest saved names."""
    import re

    lost = []
    for leaf in dict.fromkeys(leaves(source)):
        pattern = re.compile(re.sub(r"\\\{[A-Za-z_][A-Za-z0-9_]*\\\}", "[^.]+", re.escape(leaf)))
        if not any(pattern.fullmatch(n) for n in view):
            lost.append(leaf)
    what = (f"no saved tensor matches {', '.join(repr(n) for n in lost[:5])}; "
            f"{missing_advice(lost, list(view)) or 'check the names'}" if lost else
            "its source names match saved tensors, but no value of its placeholders names every part")
    return f"convert: sources[{key!r}] = {describe(source)} composes nothing from the checkpoint: {what}"
