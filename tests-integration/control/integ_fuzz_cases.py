"""Functions run inside gloo ranks for test_integ_control_fuzz.py (not a test module).

A foreign value wins the race at the exact moment dcp reads a store key: the platform's store
is wrapped so that, for keys matching one pattern, ``check`` says the key is there and
``get`` / ``multi_get`` / ``compare_set`` return the fuzz value instead of what is stored.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import time
from typing import Any

import dcp_load
import torch
from dcp_platform._torch import TorchPlatform

WAIT_S = 5.0
POISON = -7.0
MARKER = "/tmp/dcp-control-fuzz-ran"  # what a pickle payload would create, were it ever unpickled


class _Ran:
    def __reduce__(self):
        return (open, (MARKER, "w"))


def payloads(seed: int, count: int) -> list[bytes]:
    """Structured values (a pickle that runs code, older formats, JSON of the wrong shape,
    over-long values) and ``count`` random ones."""
    rng = random.Random(seed)
    out = [pickle.dumps(_Ran()), b'{"name": "weights", "nonce": "00"}', b"1,2,3", b"dcp1:lanes:1,x",
           b'dcp1:{"k":"abort","v":{"99":["x"]}}', b'dcp1:{"k":"save-outcome","v":[]}', b"dcp1:" + b"[" * 50_000,
           b"dcp1:" + b" " * (1 << 21), b'dcp1:{"k":"missing","v":[0,1]}', b"dcp1:lanes:" + b"9" * 25]
    out += [rng.randbytes(rng.randrange(0, 64)) for _ in range(count)]
    return out


class FuzzStore:
    """A store whose reads of keys matching ``pattern`` return ``value`` (module docstring)."""

    def __init__(self, inner: Any, pattern: str, value: bytes):
        self._inner, self._pattern, self._value = inner, re.compile(pattern), value
        self.hits = 0

    def _hit(self, key: str) -> bool:
        if self._pattern.search(key):
            self.hits += 1
            return True
        return False

    def check(self, keys: list[str]) -> bool:
        return any(self._hit(k) for k in keys) or self._inner.check(keys)

    def get(self, key: str) -> bytes:
        return self._value if self._hit(key) else self._inner.get(key)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        real = self._inner.compare_set(key, expected, desired)
        return self._value if self._hit(key) else real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _op(op: str, root: str, step: int) -> None:
    rank = torch.distributed.get_rank()
    path = os.path.join(root, op)
    if op == "load":
        dst = {"a": torch.full((8,), POISON)}
        dcp_load.load(dst, checkpoint_id=os.path.join(root, "ckpt"), timeout=WAIT_S)
        assert torch.equal(dst["a"], torch.full((8,), 1.0)), dst
    elif op == "save":
        dcp_load.save({"a": torch.full((8,), float(step))}, checkpoint_id=path, timeout=WAIT_S)
    elif op == "async":
        dcp_load.async_save({"a": torch.full((8,), float(step))}, checkpoint_id=path,
                            timeout=WAIT_S).result(timeout=60)
    else:
        src = {"w": torch.full((8,), float(step))} if rank == 0 else {}
        dst = {"w": torch.full((8,), POISON)}
        dcp_load.transfer(src, dst, timeout=WAIT_S)


def run_fuzz(rank: int, world: int, root: str, cases: list[tuple[str, str, int]], seed: int) -> list[Any]:
    """Each case (operation, key pattern, payload index): the call with the fuzz store on
    rank ``payload index % world`` only, then a clean call. Returns per case (outcome of
    the fuzzed call, its seconds, hits, outcome of the clean call)."""
    dcp_load.save({"a": torch.full((8,), 1.0)}, checkpoint_id=os.path.join(root, "ckpt"))
    values = payloads(seed, 40)
    real_store = TorchPlatform.store
    out = []
    for step, (op, pattern, index) in enumerate(cases):
        fuzz = None
        if rank == index % world:
            value = values[index % len(values)]

            def store(self, _p=pattern, _v=value):
                nonlocal fuzz
                inner = real_store(self)
                fuzz = fuzz if fuzz is not None else FuzzStore(inner, _p, _v)
                return fuzz if inner is not None else None
            TorchPlatform.store = store
        start = time.monotonic()
        try:
            _op(op, root, step + 2)
            outcome = "ok"
        except Exception as exc:  # noqa: BLE001 - the test asserts which types come out
            outcome = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            TorchPlatform.store = real_store
        seconds = time.monotonic() - start
        torch.distributed.barrier()
        try:
            _op(op, root, 1000 + step)
            clean = "ok"
        except Exception as exc:  # noqa: BLE001 - reported
            clean = f"{type(exc).__name__}: {str(exc)[:300]}"
        out.append((outcome, seconds, fuzz.hits if fuzz is not None else 0, clean))
        torch.distributed.barrier()
    return out
