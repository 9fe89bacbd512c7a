"""``load(sources=...)``: where a destination's values come from, as chunk geometry.

A source is a saved tensor's name (a rename), or a composition of saved tensors:
``Concat`` (with ``groups``: Megatron's query-group-interleaved QKV, gate/up fused per
tensor-parallel rank), ``Stack`` (experts) or ``Slice``. A composed source is turned into
one *virtual* saved tensor: every saved chunk of every part, cut where the composition cuts
it, is placed at its offsets in the destination's global index space (``compose``, which
gives ``Piece``s). Each piece, a virtual chunk (``_sourced_reader.VirtualChunk``),
remembers the saved chunk it came from and how its coordinates map back, so a read of any
box of it is a narrowed read of the real saved bytes. The planner, read-once, broadcasts, narrowing and casts then
see an ordinary tensor with more chunks, and nothing is staged whole.

Keys of ``sources`` may hold ``{name}`` placeholders, each matching one dot-free segment
of a destination key and substituted into the source's names (``SourceMap``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Concat", "Slice", "Source", "SourceError", "SourceMap", "Stack", "Piece", "compose",
           "describe", "leaves", "map_leaves", "sources_text"]

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _check_dim(owner: str, dim: Any) -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"{owner}: dim must be an int >= 0, got {dim!r}")


def _check_source(owner: str, source: Any) -> None:
    if not isinstance(source, (str, Concat, Stack, Slice)):
        raise TypeError(f"{owner}: a source must be a str (a saved tensor's name), dcp_load.Concat, "
                        f"dcp_load.Stack or dcp_load.Slice, got {type(source).__name__}: {source!r:.80}")


@dataclass(frozen=True)
class Slice:
    """``source`` narrowed to ``[start, stop)`` along ``dim`` (a fused tensor split back)."""

    source: Any
    dim: int
    start: int
    stop: int

    def __post_init__(self) -> None:
        _check_source("Slice", self.source)
        _check_dim("Slice", self.dim)
        for what in ("start", "stop"):
            v = getattr(self, what)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"Slice of {describe(self.source)}: {what} must be an int >= 0, got {v!r}")
        if self.stop <= self.start:
            raise ValueError(f"Slice of {describe(self.source)}: stop ({self.stop}) must be above start "
                             f"({self.start})")


def _parts(owner: str, parts: Any) -> tuple[Any, ...]:
    if isinstance(parts, (str, bytes)) or not isinstance(parts, Sequence) or not parts:
        raise TypeError(f"{owner}: parts must be a non-empty list of sources (str or Slice), got {parts!r:.80}")
    out = tuple(parts)
    for p in out:
        _check_source(owner, p)
    return out


@dataclass(frozen=True)
class Concat:
    """``parts`` concatenated along ``dim``. With ``groups=g`` each part is cut into ``g``
    equal blocks along ``dim`` and the result holds block 0 of every part, then block 1 of
    every part, and so on (``g`` = KV heads: grouped QKV; ``g`` = TP size: per-rank gate/up)."""

    parts: Sequence[Any]
    dim: int = 0
    groups: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", _parts("Concat", self.parts))
        _check_dim("Concat", self.dim)
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"Concat: groups must be an int >= 1, got {self.groups!r}")


@dataclass(frozen=True)
class Stack:
    """``parts`` (of one shape) stacked along a new dimension ``dim`` (experts)."""

    parts: Sequence[Any]
    dim: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", _parts("Stack", self.parts))
        _check_dim("Stack", self.dim)


Source = str | Concat | Stack | Slice


def describe(source: Any) -> str:
    """A short text of a source for messages."""
    if isinstance(source, str):
        return repr(source)
    if isinstance(source, Slice):
        return f"Slice({describe(source.source)}, dim={source.dim}, {source.start}:{source.stop})"
    parts = ", ".join(describe(p) for p in source.parts[:3]) + (", ..." if len(source.parts) > 3 else "")
    extra = f", groups={source.groups}" if isinstance(source, Concat) and source.groups != 1 else ""
    return f"{type(source).__name__}([{parts}], dim={source.dim}{extra})"


def sources_text(sources: Any) -> str:
    """``sources=`` as the text ranks compare: entries in key order, since the order a
    mapping was built in does not change what it maps (``SourceMap.match`` finds at most
    one entry per destination, whatever their order)."""
    if not isinstance(sources, Mapping):
        return repr(sources)
    return "{" + ", ".join(f"{k!r}: {v!r}" for k, v in sorted(sources.items(), key=lambda kv: repr(kv[0]))) + "}"


def leaves(source: Any) -> list[str]:
    """The saved tensor names a source reads, in order."""
    if isinstance(source, str):
        return [source]
    if isinstance(source, Slice):
        return leaves(source.source)
    return [n for p in source.parts for n in leaves(p)]


def map_leaves(source: Any, rename: Any) -> Any:
    """``source`` with each saved name ``n`` it reads replaced by ``rename(n)``."""
    if isinstance(source, str):
        return rename(source)
    if isinstance(source, Slice):
        return Slice(map_leaves(source.source, rename), source.dim, source.start, source.stop)
    parts = [map_leaves(p, rename) for p in source.parts]
    return Concat(parts, source.dim, source.groups) if isinstance(source, Concat) else Stack(parts, source.dim)


def _substitute(source: Any, binding: Mapping[str, str]) -> Any:
    return map_leaves(source, lambda name: _PLACEHOLDER.sub(lambda m: binding[m.group(1)], name))


def _pattern(template: str) -> tuple[re.Pattern[str] | None, tuple[str, ...]]:
    """A regex matching names of ``template`` (each ``{p}`` one dot-free segment; a repeated
    placeholder must repeat its value) and the placeholders in order of appearance. None
    for a plain name (compared, not matched: compiling tens of thousands took seconds)."""
    if "{" not in template or not _PLACEHOLDER.search(template):
        return None, ()
    out, names, pos = [], [], 0
    for m in _PLACEHOLDER.finditer(template):
        out.append(re.escape(template[pos:m.start()]))
        p = m.group(1)
        out.append(f"(?P={p})" if p in names else f"(?P<{p}>[^.]+)")
        if p not in names:
            names.append(p)
        pos = m.end()
    out.append(re.escape(template[pos:]))
    return re.compile("".join(out)), tuple(names)


class SourceMap:
    """The ``sources=`` argument, checked: ``match`` a destination key to its source."""

    def __init__(self, sources: Mapping[str, Any], owner: str = "load"):
        # ``owner``: the function messages name (``load``, ``convert``)
        if not isinstance(sources, Mapping):
            raise TypeError(f"{owner}: sources must be a mapping from destination keys to sources, got "
                            f"{type(sources).__name__}")
        self.entries: list[tuple[str, re.Pattern[str] | None, tuple[str, ...], Any]] = []
        # keys without placeholders are looked up, not matched: a generated mapping of one
        # rename per key (tens of thousands) must not cost keys x destinations regex matches
        self.exact: dict[str, int] = {}
        self.patterned: list[int] = []
        for key, source in sources.items():
            if not isinstance(key, str):
                raise TypeError(f"{owner}: sources keys must be str destination keys, got {key!r:.80}")
            _check_source(f"sources[{key!r}]", source)
            regex, names = _pattern(key)
            used = {p for leaf in leaves(source) for p in _PLACEHOLDER.findall(leaf)}
            unknown = sorted(used - set(names))
            if unknown:
                raise ValueError(f"{owner}: sources[{key!r}] = {describe(source)} uses placeholder(s) "
                                 f"{', '.join('{' + p + '}' for p in unknown)} that the key lacks; every "
                                 "placeholder of a source must appear in its key")
            unused = [p for p in names if p not in used]
            if unused:
                raise ValueError(f"{owner}: sources[{key!r}]: placeholder(s) "
                                 f"{', '.join('{' + p + '}' for p in unused)} of the key appear in no source "
                                 f"name of {describe(source)}; use each placeholder in the source's names")
            if names:
                self.patterned.append(len(self.entries))
            else:
                self.exact[key] = len(self.entries)
            self.entries.append((key, regex, names, source))
        self.owner = owner

    def match(self, name: str) -> tuple[str, Any] | None:
        """(entry key, source with placeholders substituted) for destination ``name``, None
        when no entry matches; ValueError when two do."""
        found = []
        exact = self.exact.get(name)
        for i in sorted(([exact] if exact is not None else []) + self.patterned):
            key, regex, _, source = self.entries[i]
            m = regex.fullmatch(name) if regex is not None else None
            if m or regex is None:  # a plain key is only looked up for its own name
                found.append((key, _substitute(source, m.groupdict() if m else {})))
        if len(found) > 1:
            raise ValueError(f"{self.owner}: destination {name!r} matches {len(found)} sources entries "
                             f"({', '.join(repr(k) for k, _ in found)}); make the keys match one each")
        return found[0] if found else None

    def enumerate(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """Every destination name each entry can compose from the checkpoint's names (all of
        its source names saved), mapped to its substituted source. Depends only on the
        checkpoint and ``sources``: every rank derives the same names, whatever it holds.
        The first entry wins a name two entries give (a destination holding it is refused)."""
        out: dict[str, Any] = {}
        for key, regex, names, source in self.entries:
            for binding in _bindings(leaves(source), names, saved):
                dest = _PLACEHOLDER.sub(lambda m, b=binding: b[m.group(1)], key)
                # two placeholders in one segment can split a name two ways: keep only the
                # binding ``match`` gives the name, so the tensor loaded is the one it names
                if dest not in out and (regex is None or regex.fullmatch(dest).groupdict() == binding):
                    out[dest] = _substitute(source, binding)
        return out


def _bindings(templates: Sequence[str], names: tuple[str, ...], saved: Mapping[str, Any]) -> list[dict[str, str]]:
    """Placeholder values for which every template names a saved tensor (a join over the
    templates, most placeholders first; templates already bound are looked up, not matched)."""
    if not names:
        return [{}] if all(t in saved for t in templates) else []
    order = sorted(dict.fromkeys(templates), key=lambda t: -len(set(_PLACEHOLDER.findall(t))))
    found: list[dict[str, str]] = [{}]
    for template in order:
        regex, own = _pattern(template)
        if all(p in found[0] for p in own):  # every binding has the same placeholders
            found = [b for b in found if _PLACEHOLDER.sub(lambda m, b=b: b[m.group(1)], template) in saved]
        else:
            matches = [m.groupdict() for m in map(regex.fullmatch, saved) if m]
            found = [{**b, **m} for b in found for m in matches
                     if all(b.get(p, v) == v for p, v in m.items())]
        if not found:
            return []
    return sorted(found, key=lambda b: tuple(b[p] for p in names))


class SourceError(ValueError):
    """A source that cannot give a destination: the message names the part and the dim."""


@dataclass(frozen=True)
class Piece:
    """A box of a composed source, read from saved chunk ``real`` of tensor ``source``.

    ``offsets``/``sizes``: the box in the destination's global coordinates. Real dimension
    ``d`` is virtual dimension ``axes[d]``, with ``real = virtual + shift[d]``; virtual
    dimensions no real one maps to were added by ``Stack`` (size 1 here).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    source: str
    real: Any
    axes: tuple[int, ...]
    shift: tuple[int, ...]


def _leaf(name: str, saved: Mapping[str, Any]) -> tuple[tuple[int, ...], list[str], list[Piece]]:
    meta = saved[name]
    nd = len(meta.shape)
    return tuple(meta.shape), [meta.dtype], [
        Piece(tuple(c.offsets), tuple(c.sizes), name, c, tuple(range(nd)), (0,) * nd) for c in meta.chunks]


def _shifted(c: Piece, dim: int, lo: int, size: int, new_lo: int) -> Piece:
    """``c`` cut to ``[lo, lo+size)`` along ``dim`` and moved to start at ``new_lo``."""
    offsets = (*c.offsets[:dim], new_lo, *c.offsets[dim + 1:])
    sizes = (*c.sizes[:dim], size, *c.sizes[dim + 1:])
    shift = tuple(s - (new_lo - lo) if a == dim else s for a, s in zip(c.axes, c.shift, strict=True))
    return Piece(offsets, sizes, c.source, c.real, c.axes, shift)


def compose(source: Any, saved: Mapping[str, Any], where: str
            ) -> tuple[tuple[int, ...], list[str], list[Piece]]:
    """(shape, dtypes of the parts, chunks) of ``source`` over the checkpoint's tensors
    ``saved``. SourceError (message starting with ``where``) when the parts do not fit."""
    if isinstance(source, str):
        if source not in saved:
            raise SourceError(f"{where}: source {source!r} is not a tensor of the checkpoint", source)
        return _leaf(source, saved)
    if isinstance(source, Slice):
        shape, dtypes, chunks = compose(source.source, saved, where)
        d = source.dim
        if d >= len(shape) or source.stop > shape[d]:
            raise SourceError(f"{where}: {describe(source)} is out of range: {describe(source.source)} has shape "
                              f"{shape}" + (f" ({shape[d]} along dim {d})" if d < len(shape) else
                                            f" (no dim {d})"))
        out = []
        for c in chunks:
            lo, hi = max(c.offsets[d], source.start), min(c.offsets[d] + c.sizes[d], source.stop)
            if hi > lo:
                out.append(_shifted(c, d, lo, hi - lo, lo - source.start))
        return (*shape[:d], source.stop - source.start, *shape[d + 1:]), dtypes, out
    parts = [compose(p, saved, where) for p in source.parts]
    if isinstance(source, Stack):
        return _stack(source, parts, where)
    return _concat(source, parts, where)


def _same_shapes(source: Any, parts: Sequence[Any], where: str, skip: int | None) -> tuple[int, ...]:
    first = parts[0][0]
    for p, (shape, _, _) in zip(source.parts, parts, strict=True):
        if len(shape) != len(first) or any(a != b for i, (a, b) in enumerate(zip(shape, first, strict=False)) if i != skip):
            along = "" if skip is None else f" outside dim {skip}"
            raise SourceError(f"{where}: {describe(source)}: part {describe(p)} has shape {shape} but part "
                              f"{describe(source.parts[0])} has {first}; the parts' shapes must agree{along}")
    return first


def _stack(source: Stack, parts: Sequence[Any], where: str) -> tuple[tuple[int, ...], list[str], list[Piece]]:
    first = _same_shapes(source, parts, where, None)
    d = source.dim
    if d > len(first):
        raise SourceError(f"{where}: {describe(source)}: dim {d} is out of range for parts of shape {first} "
                          f"(at most {len(first)})")
    out = []
    for i, (_, _, chunks) in enumerate(parts):
        for c in chunks:
            axes = tuple(a + 1 if a >= d else a for a in c.axes)
            out.append(Piece((*c.offsets[:d], i, *c.offsets[d:]), (*c.sizes[:d], 1, *c.sizes[d:]),
                                    c.source, c.real, axes, c.shift))
    return (*first[:d], len(parts), *first[d:]), [t for p in parts for t in p[1]], out


def _concat(source: Concat, parts: Sequence[Any], where: str) -> tuple[tuple[int, ...], list[str], list[Piece]]:
    d, g = source.dim, source.groups
    first = _same_shapes(source, parts, where, d)
    if d >= len(first):
        raise SourceError(f"{where}: {describe(source)}: dim {d} is out of range for parts of shape {first}")
    for p, (shape, _, _) in zip(source.parts, parts, strict=True):
        if shape[d] % g:
            raise SourceError(f"{where}: {describe(source)}: groups={g} does not divide part {describe(p)}, "
                              f"which has {shape[d]} along dim {d}")
    blocks = [shape[d] // g for shape, _, _ in parts]
    stride = sum(blocks)
    out = []
    before = 0
    for block, (_, _, chunks) in zip(blocks, parts, strict=True):
        for c in chunks:
            lo, hi = c.offsets[d], c.offsets[d] + c.sizes[d]
            for k in range(lo // block, -(-hi // block)) if block else ():
                a, b = max(lo, k * block), min(hi, (k + 1) * block)
                out.append(_shifted(c, d, a, b - a, k * stride + before + a - k * block))
        before += block
    return (*first[:d], stride * g, *first[d + 1:]), [t for p in parts for t in p[1]], out
