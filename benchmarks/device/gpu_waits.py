"""The device path's waits on a real CUDA device: each one removed in turn gives wrong values.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/device/gpu_waits.py   # one GPU, < 1 min

The fake accelerator (``dcp_platform.testing.FakeAccelerator``) makes every copy late, so
the CPU tests show a missing wait as a wrong value; here the same holds on CUDA streams and
events. Every copy the engine queues (``DeviceCopies._copy``) is made late by a spin kernel
of ``LATE_MS`` queued before it on the copy stream, so a wait left out is a wrong value,
not a race the copy may win. One process, no process group. Each case runs with every
wait in place (the values must be exact) and with one wait removed (they must not be):

* ``begin``: the copy stream after the caller's current stream. The caller queues a
  write of NaN to the destinations behind a ``CALLER_MS`` spin before ``load``; the load's
  copies must land after it. For ``async_save``, the caller's last write to its tensors
  before the call must be what is saved.
* ``ring``: a pinned buffer handed out again only once its copy ran (``PinnedRing.acquire``).
* ``finish``: the load waits for its copy stream before it returns (``DeviceLoad.finish``);
  the platform's ``synchronize`` is made a no-op for this case (a CUDA platform's
  ``torch.cuda.synchronize`` at the end of a load would hide the missing wait).
* ``staged``: ``async_save``'s wait for its device-to-host copies before the caller may
  change its tensors (``StagingPool._copy_all``).

Destinations: float32, bfloat16 (cast on the device after the transfer) and a transposed
(strided) view. Prints one line per case and writes ``--json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

LATE_MS = 5.0  # each host-device copy waits this long on its stream
CALLER_MS = 1000.0  # the caller's pending work before its write, on its own stream
NAMES = [f"w{i}" for i in range(8)]  # 8 pieces of 1 MiB: more than the ring's 4 buffers


_CYCLES_PER_MS: list[float] = []


def _spin(torch: Any, ms: float) -> None:
    """Queue ``ms`` of device time on the current stream (a spin kernel, timed once)."""
    if not _CYCLES_PER_MS:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # warm-up
        start.record()
        torch.cuda._sleep(50_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(50_000_000 / start.elapsed_time(end))
    torch.cuda._sleep(int(ms * _CYCLES_PER_MS[0]))


def _source(torch: Any) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {n: torch.randn(512, 512, generator=g) for n in NAMES}


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    saved = obj.__dict__[name]
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


@contextlib.contextmanager
def _late_copies(torch: Any) -> Iterator[None]:
    from dcp_platform._device import DeviceCopies

    plain = DeviceCopies._copy

    def late(self: Any, dst: Any, src: Any) -> None:
        _spin(torch, LATE_MS)  # on the copy stream: the copy runs LATE_MS after it was queued
        plain(self, dst, src)

    with _patched(DeviceCopies, "_copy", late):
        yield


def _destinations(torch: Any, src: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, (n, v) in enumerate(src.items()):
        if k % 3 == 1:
            out[n] = torch.empty(v.shape, dtype=torch.bfloat16, device="cuda")
        elif k % 3 == 2:
            out[n] = torch.empty(tuple(reversed(v.shape)), device="cuda").t()
        else:
            out[n] = torch.empty(v.shape, device="cuda")
        out[n].fill_(float("nan"))
    torch.cuda.synchronize()
    return out


def _wrong(torch: Any, got: dict[str, Any], src: dict[str, Any]) -> list[str]:
    return [n for n, v in src.items() if not torch.equal(got[n].cpu(), v.to(got[n].dtype))]


def load_case(torch: Any, path: str, src: dict[str, Any], removed: str | None) -> list[str]:
    """Names loaded wrong with the wait ``removed`` (None: every wait in place)."""
    import dcp_load
    from dcp_load.run._device import DeviceLoad
    from dcp_platform import get_platform
    from dcp_platform._device import DeviceCopies, PinnedRing

    dst = _destinations(torch, src)
    platform = get_platform("torch")
    patches: list[Any] = []
    if removed == "begin":
        patches.append(_patched(DeviceCopies, "begin", lambda self: None))
    elif removed == "ring":
        plain_acquire = PinnedRing.acquire

        def careless(self: Any) -> Any:
            with _patched(type(self._copies), "wait_event", lambda copies, event: None):
                return plain_acquire(self)

        patches.append(_patched(PinnedRing, "acquire", careless))
    if removed == "finish" or removed is None:  # no platform-wide synchronize, in both runs alike
        patches.append(_patched(type(platform), "synchronize", lambda self: None))
    if removed == "finish":
        patches.append(_patched(DeviceLoad, "finish", lambda self: None))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        _spin(torch, CALLER_MS)
        for v in dst.values():
            v.fill_(float("nan"))  # the caller's last write, still pending when load is called
        dcp_load.load(dst, checkpoint_id=path, no_dist=True, platform=platform)
        got = {n: v.clone() for n, v in dst.items()}  # on the caller's stream, as load returned it
    torch.cuda.synchronize()
    return _wrong(torch, got, src)


def save_case(torch: Any, path: str, src: dict[str, Any], removed: str | None) -> list[str]:
    """Names saved wrong by ``async_save`` of CUDA tensors with the wait ``removed``."""
    import dcp_load
    from dcp_platform import get_platform
    from dcp_platform._device import DeviceCopies

    dev = {n: torch.zeros(v.shape, device="cuda") for n, v in src.items()}
    values = {n: v.to("cuda") for n, v in src.items()}
    torch.cuda.synchronize()
    for n, v in dev.items():
        _spin(torch, CALLER_MS / len(dev))
        v.copy_(values[n])  # the values at the call: a device copy still queued behind a spin
    patches: list[Any] = []
    if removed == "begin":
        patches.append(_patched(DeviceCopies, "begin", lambda self: None))
    elif removed == "staged":
        patches.append(_patched(DeviceCopies, "wait_event", lambda self, event: None))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        try:
            fut = dcp_load.async_save(dev, checkpoint_id=path, no_dist=True, platform=get_platform("torch"))
            for v in dev.values():
                v.fill_(7.0)  # the caller's next step
            fut.result()
        finally:
            dcp_load.release_staging()
    torch.cuda.synchronize()
    out = {n: torch.zeros_like(v) for n, v in src.items()}
    dcp_load.load(out, checkpoint_id=path, no_dist=True)
    return _wrong(torch, out, src)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import dcp_load
    import torch

    if not torch.cuda.is_available():
        sys.exit("gpu_waits: no CUDA device visible to torch")
    src = _source(torch)
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    ok = True
    with tempfile.TemporaryDirectory() as tmp, _late_copies(torch):
        dcp_load.save(src, checkpoint_id=f"{tmp}/c", no_dist=True)
        cases = [("load", r, load_case) for r in (None, "begin", "ring", "finish")]
        cases += [("async_save", r, save_case) for r in (None, "begin", "staged")]
        for k, (what, removed, fn) in enumerate(cases):
            path = f"{tmp}/c" if what == "load" else f"{tmp}/s{k}"
            wrong = fn(torch, path, src, removed)
            good = (wrong == []) if removed is None else bool(wrong)
            ok &= good
            results[f"{what}, {removed or 'every wait'}"] = wrong
            print(f"{what:10s} {'without ' + removed if removed else 'every wait':16s} wrong: {len(wrong)} of "
                  f"{len(src)} {wrong} -> {'as expected' if good else 'NOT AS EXPECTED'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
