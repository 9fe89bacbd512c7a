"""A walk over a pickle's opcodes that builds nothing, run before any unpickler sees the bytes.

It refuses, with the reason and the byte offset (``scan_pickle``):
- a length prefix that is negative or runs past the end. BINSTRING and LONG4 carry signed
  lengths: read as such, ``b"T\\xfb\\xff\\xff\\xff."`` moved the walk 5 bytes back, forever.
- memo indices out of order: pickle numbers them 0, 1, 2, ...; the C unpickler grows its
  memo table to the index given, so one corrupted byte made ``b"\\x80\\x04}r\\x00\\x00\\x00\\x08."``
  (13 bytes) allocate ~1.8 GB.
- nesting deeper than ``max_depth``. Hashing a tuple recurses in C without a depth check:
  a dict key of 200,000 nested tuples (EMPTY_TUPLE then TUPLE1 repeated, 1 byte per level)
  overflowed the C stack (SIGSEGV) in pickle's C unpickler and in torch.load alike.
- copies beyond ``copy_budget`` elements: a call (REDUCE, NEWOBJ, OBJ, INST, BINPERSID)
  or a BUILD may copy its arguments and the containers among them, so each is charged their
  lengths as they stand when it runs. One 20,000-element tuple passed to 5,000 calls, a
  45 KB pickle, otherwise copied 100 million references (780 MiB) before any check of the
  result. This bounds unpicklers that cannot count for themselves (torch.load's).
- malformed structure the unpickler would refuse anyway (unknown opcode, stack underflow,
  no mark, truncation), so that the depth it tracks is the depth that gets built.

Each object built is a node ``[depth, length, items]`` shared by every reference to it (the
stack, the memo, containers holding it), so a container filled after it was memoized
(APPEND, SETITEM(S), ADDITEMS, BUILD) is longer and deeper for every reference. A
container already placed inside another when it deepens does not update that parent's
depth: only tuples and frozensets hash their items, and a tuple's items are fixed when it
is built. A call's result is given the longest of its arguments and their items (what it could
hold a copy of).
"""

from __future__ import annotations

import pickletools
from typing import Any

# Python's pickler stops at the interpreter's recursion limit (1000): a pickle nested
# deeper was not written by it. Hashing 1000 nested tuples uses well under 1 MiB of C stack.
MAX_DEPTH = 1000

# How each opcode's argument is laid out, from pickletools' table: a fixed byte count (>= 0),
# or one of pickletools' codes: -1 up to a newline, -2/-3/-4/-5 a length prefix of 1/4
# (signed)/4/8 bytes. A walk that only skips arguments was 2.6x faster than
# pickletools.genops, which decodes every one (a 9.5 MB torch DCP metadata of 64,000
# chunks, on a 2-core machine at load average 16: 5.2 s against 13.5 s, while unpickling
# it took 19 s).
_ARG: dict[int, int] = {}
_LINES: dict[int, int] = {}
_KIND: dict[int, int] = {}
# what an opcode does to the stack
(_SCALAR, _EMPTY, _TUPLE_N, _FROM_MARK, _CALL, _CALL_MARK, _GLOBAL2, _APPEND, _SETITEM, _BUILD, _ADD_MARK,
 _MARK, _POP, _POP_MARK, _DUP, _PUT, _GET, _MEMOIZE, _NONE, _STOP) = range(20)
_KINDS = {
    "EMPTY_LIST": _EMPTY, "EMPTY_TUPLE": _EMPTY, "EMPTY_DICT": _EMPTY, "EMPTY_SET": _EMPTY,
    "TUPLE1": _TUPLE_N, "TUPLE2": _TUPLE_N, "TUPLE3": _TUPLE_N,
    "LIST": _FROM_MARK, "TUPLE": _FROM_MARK, "DICT": _FROM_MARK, "FROZENSET": _FROM_MARK,
    "REDUCE": _CALL, "NEWOBJ": _CALL, "NEWOBJ_EX": _CALL, "BINPERSID": _CALL,
    "OBJ": _CALL_MARK, "INST": _CALL_MARK, "STACK_GLOBAL": _GLOBAL2,
    "APPEND": _APPEND, "SETITEM": _SETITEM, "BUILD": _BUILD,
    "APPENDS": _ADD_MARK, "SETITEMS": _ADD_MARK, "ADDITEMS": _ADD_MARK,
    "MARK": _MARK, "POP": _POP, "POP_MARK": _POP_MARK, "DUP": _DUP,
    "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET,
    "MEMOIZE": _MEMOIZE, "PROTO": _NONE, "FRAME": _NONE, "READONLY_BUFFER": _NONE, "STOP": _STOP,
}
# how many stack items the fixed-arity opcodes take
_TAKES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3, "BINPERSID": 1}
_TAKE: dict[int, int] = {}
for _op in pickletools.opcodes:
    _code = ord(_op.code.encode("latin-1"))
    _ARG[_code] = _op.arg.n if _op.arg is not None else 0
    _LINES[_code] = 2 if _op.name in ("GLOBAL", "INST") else 1
    _KIND[_code] = _KINDS.get(_op.name, _SCALAR)  # the rest push one new object
    _TAKE[_code] = _TAKES.get(_op.name, 0)
_WIDTH = {-2: 1, -3: 4, -4: 4, -5: 8}
_TEXT_INDEX = {ord("p"), ord("g")}  # PUT, GET: the index is a decimal line
_FRAME = ord("\x95")
_MOVES = frozenset((_POP_MARK, _POP, _DUP, _STOP))  # what ``_Walk._move`` applies


_LEAF = (0, 0, ())  # scalars, globals: nothing inside (tuples are never changed: nodes that change are lists)
_SHORT = 24  # opcodes of at most this many bytes push a _LEAF: a copy of a short str costs what its bytes do


def copy_budget(size: int) -> int:
    """Elements the calls of a ``size``-byte pickle may copy: what its own bytes build, twice,
    plus a fixed allowance (the restricted unpickler's budget)."""
    return 65536 + 2 * size


def scan_pickle(data: bytes, start: int = 0, *, max_depth: int = MAX_DEPTH, budget: int | None = None
                ) -> tuple[str | None, int]:
    """(why the pickle starting at byte ``start`` of ``data`` must not be unpickled, or None;
    the offset just past its STOP opcode, or where the problem lies). ``budget``: elements
    its calls may copy (``copy_budget`` of its size when None). Builds nothing; every opcode
    moves the walk forward, so it ends after at most ``len(data) - start`` steps."""
    pos, end = start, len(data)
    walk = _Walk(max_depth, copy_budget(end - start) if budget is None else budget)
    stack, marks, memo = walk.stack, walk.marks, walk.memo
    arg, kinds = _ARG, _KIND
    while pos < end:
        at = pos
        code = data[pos]
        n = arg.get(code)
        if n is None:
            return f"unknown pickle opcode {code:#x} at byte {at}", at
        pos += 1
        kind = kinds[code]
        index = None
        if n > 0:
            if pos + n > end:
                return f"opcode {code:#x} at byte {at} runs past the end ({end} bytes): truncated", at
            if kind == _PUT or kind == _GET:
                index = int.from_bytes(data[pos:pos + n], "little")
            elif code == _FRAME and pos + n + int.from_bytes(data[pos:pos + n], "little") > end:
                return f"a frame at byte {at} runs past the end ({end} bytes)", at
            pos += n
        elif n == -1:  # protocol 0's newline-ended arguments (rare: not on the hot path)
            why, pos, index = _text_argument(data, pos, code, at)
            if why:
                return why, at
        elif n < 0:
            width = _WIDTH[n]
            length = int.from_bytes(data[pos:pos + width], "little", signed=n == -3)
            if pos + width > end or length < 0 or pos + width + length > end:
                why = "is negative" if length < 0 else f"runs past the end ({end} bytes)"
                return f"opcode {code:#x} at byte {at} gives length {length}, which {why}", at
            pos += width + length
        if kind == _SCALAR:  # the most common opcodes first, without a call
            # a long str or bytes is as long as its text: list(s) copies it item by item
            stack.append(_LEAF if pos - at <= _SHORT else (0, pos - at, ()))
            continue
        if kind == _GET and index is not None and index < len(memo):
            stack.append(memo[index])
            continue
        if kind == _MEMOIZE and len(stack) > (marks[-1] if marks else 0):
            memo.append(stack[-1])
            continue
        if kind == _EMPTY:
            stack.append([1, 0, []])
            continue
        if kind == _MARK:
            marks.append(len(stack))
            continue
        try:
            if walk.step(kind, _TAKE[code], index):
                return None, pos
        except _Refused as e:
            return f"{e.args[0]} at byte {at} (opcode {code:#x})", at
    return f"no STOP opcode before the end ({end} bytes): the pickle is truncated", end


def _text_argument(data: bytes, pos: int, code: int, at: int) -> tuple[str | None, int, int | None]:
    """(a problem or None, the offset past the argument's lines, the memo index it gives)."""
    index = None
    for _ in range(_LINES[code]):
        nl = data.find(b"\n", pos)
        if nl < 0:
            return f"unterminated argument of opcode {code:#x} at byte {at}", pos, None
        if code in _TEXT_INDEX:
            try:
                index = int(data[pos:nl])
            except ValueError:
                return f"bad memo index {data[pos:nl][:20]!r} at byte {at}", pos, None
        pos = nl + 1
    return None, pos, index


class _Refused(Exception):
    pass


class _Walk:
    """The stack, marks and memo of nodes, kept as pickle's C unpickler keeps its objects
    (nothing below the last mark can be popped), and what the calls may copy."""

    def __init__(self, max_depth: int, budget: int):
        self.stack: list = []
        self.marks: list[int] = []
        self.memo: list = []
        self.max_depth = max_depth
        self.left = self.budget = budget

    def _fence(self) -> int:
        return self.marks[-1] if self.marks else 0

    def _take(self, k: int) -> list:
        """The top ``k`` nodes, popped (all above the last mark)."""
        stack = self.stack
        cut = len(stack) - k
        if cut < self._fence():
            raise _Refused("stack underflow")
        items = stack[cut:]
        del stack[cut:]
        return items

    def _to_mark(self) -> list:
        if not self.marks:
            raise _Refused("no MARK before it")
        m = self.marks.pop()
        items = self.stack[m:]
        del self.stack[m:]
        return items

    def _top(self) -> list:
        """The node to fill (a container, or an object to BUILD), above the last mark."""
        if len(self.stack) <= self._fence():
            raise _Refused("stack underflow")
        node = self.stack[-1]
        if type(node) is tuple:  # a leaf given state: a node of its own from now on
            node = self.stack[-1] = [node[0], node[1], []]
        return node

    def _node(self, items: list, length: int) -> list:
        depth = 0
        for d in items:
            if d[0] > depth:
                depth = d[0]
        depth += 1
        if depth > self.max_depth:
            raise _Refused(f"nesting {depth} levels deep (more than {self.max_depth}; Python's pickler "
                           "writes at most ~1000)")
        return [depth, length, items]

    def _copies(self, node: Any) -> int:
        """Charge a call or BUILD given the container ``node``: it may copy it and each of its
        items. Returns what the result can hold: the longest of them (torch.Size(list),
        OrderedDict(pairs), a record of its args), not their sum, which would grow along a
        chain of calls without anything being copied. The work is bounded by the charge."""
        longest = node[1]
        self.left -= longest
        if self.left >= 0:
            total = 0
            for item in node[2]:
                n = item[1]
                if n:
                    total += n
                    if n > longest:
                        longest = n
            self.left -= total
        if self.left < 0:
            raise _Refused(f"calls that copy more than {self.budget} elements (shared containers passed "
                           "again and again: a memory bomb)")
        return longest

    def _fill(self, node: list, items: list, count: int) -> None:
        new = self._node(items, count)
        if new[0] > node[0]:
            node[0] = new[0]
        node[1] += count
        node[2].extend(items)

    def step(self, kind: int, take: int, index: int | None) -> bool:
        """Apply one opcode's effect; True at STOP."""
        if kind == _GET or kind == _MEMOIZE or kind == _PUT:
            self._memo_op(kind, index)
        elif kind in _MOVES:
            return self._move(kind)
        else:
            self._build(kind, take)
        return False

    def _memo_op(self, kind: int, index: int | None) -> None:
        """GET pushes a stored node; MEMOIZE and PUT store the top one (indices in order)."""
        stack, memo = self.stack, self.memo
        if kind == _GET:
            if index is None or not 0 <= index < len(memo):
                raise _Refused(f"memo index {index} but only {len(memo)} entries were stored before "
                               "it (pickle numbers them in order)")
            stack.append(memo[index])
            return
        if len(stack) <= self._fence():
            raise _Refused("stack underflow")
        if kind == _MEMOIZE or index == len(memo):
            memo.append(stack[-1])
        elif index is not None and 0 <= index < len(memo):
            memo[index] = stack[-1]
        else:
            raise _Refused(f"memo index {index} but only {len(memo)} entries were stored before "
                           "it (pickle numbers them in order)")

    def _move(self, kind: int) -> bool:
        """POP_MARK, POP, DUP, STOP: move nodes without building one; True at STOP."""
        stack = self.stack
        if kind == _POP_MARK:
            self._to_mark()
        elif kind == _POP:
            if self.marks and self.marks[-1] == len(stack):
                self.marks.pop()  # POP right after MARK drops the mark, as the C unpickler does
            else:
                self._take(1)
        elif kind == _DUP:
            if len(stack) <= self._fence():
                raise _Refused("stack underflow")
            stack.append(stack[-1])
        elif kind == _STOP:
            self._take(1)
            return True
        return False

    def _build(self, kind: int, take: int) -> None:
        """The opcodes that make a node or fill one: tuples, calls, containers, BUILD."""
        stack = self.stack
        if kind == _TUPLE_N:
            items = self._take(take)
            stack.append(self._node(items, take))
        elif kind == _CALL:  # REDUCE, NEWOBJ(_EX): callable, args[, kwargs]; BINPERSID: pid
            items = self._take(take)
            longest = max(self._copies(a) for a in (items[1:] if take > 1 else items))
            stack.append(self._node(items, longest))
        elif kind == _CALL_MARK:  # OBJ, INST: a class called with the items above the mark
            items = self._to_mark()
            stack.append(self._node(items, self._copies((0, len(items), items))))
        elif kind == _GLOBAL2:
            self._take(2)
            stack.append(_LEAF)
        elif kind == _APPEND or kind == _SETITEM:
            items = self._take(1 if kind == _APPEND else 2)
            self._fill(self._top(), items, 1)
        elif kind == _BUILD:
            state = self._take(1)
            longest = self._copies(state[0])
            node = self._top()
            self._fill(node, state, 0)
            node[1] = max(node[1], longest)
        elif kind == _FROM_MARK:
            items = self._to_mark()
            stack.append(self._node(items, len(items)))
        elif kind == _ADD_MARK:
            items = self._to_mark()
            self._fill(self._top(), items, len(items))
