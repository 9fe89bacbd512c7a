"""A weight-sync group joining two separately launched jobs (a trainer and an inference engine).

Each job keeps its own default process group; this module never touches it. The ranks of
both jobs meet in a ``torch.distributed.TCPStore`` that trainer rank 0 hosts, check that
they agree (a handshake: the group's name, dcp-load's version, both world sizes and the
backend), and build one process group over all of them from that store: trainer ranks
``0..T-1``, engine ranks ``T..T+E-1``. ``transfer(..., process_group=group)`` then moves
weights across the two jobs as it does within one (``dcp_platform``'s ``GroupView`` runs
every collective on the group object itself, which torch's registry never sees).

Trainer rank 0 opens each group under a fresh nonce (``OPEN_KEY``: the group's name and
nonce) and removes it when the group closes; the others wait for an open group (reconnecting
while a closed group's server goes away), and every key of the group (greetings, claims,
collectives, and the group's key, which names its kept plans and call counts) carries the
nonce. So a process that rejoins after the other side restarted, or right after a
``close()``, never reads an earlier group's greetings, and both sides count their calls
from 0. A rank claims its (side, rank) with an ``add``: a second process claiming it fails.

The handshake is two rounds through the store, each bounded by ``timeout``: every rank
first reads both leaders' greetings (trainer rank 0 and engine rank 0, which always exist),
then every rank's. Each rank compares every greeting it read with its own, so a
disagreement raises the same ``TransferGroupError`` on every rank that reads it, naming
the sides, ranks and values; a rank that never arrives is named when the bound expires.
"""

from __future__ import annotations

import contextlib
import errno
import re
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from dcp_platform.codec import ControlMessageError, decode, encode

from .._errors import LoadError

__all__ = ["TransferGroup", "TransferGroupError", "sides_named", "transfer_group"]

#: The handshake's format; a change that makes older ranks plan differently bumps it.
PROTOCOL = 1

SIDES = ("trainer", "engine")

#: How often a waiting rank polls the store for greetings (a store ``check`` is one round
#: trip on the loopback, well under a millisecond).
POLL_S = 0.02


#: How long the hosting rank keeps the store up after a failed handshake for the others to
#: fail too: they read the same greetings within milliseconds of each other; a rank that
#: never came is not waited for longer than this.
LINGER_S = 10.0

#: The server key under which trainer rank 0 publishes the open group: ``{"name", "nonce"}``.
OPEN_KEY = "dcp-sync/open"

#: The key each rank adds 1 to as it closes the group (``TransferGroup._closing``).
CLOSING_KEY = "dcp-sync/closing"

#: The longest single attempt to reach the server; attempts repeat until the bound (torch's
#: client may take twice its timeout to give up, so a short attempt keeps the bound).
CONNECT_TRY_S = 1.0


class TransferGroupError(RuntimeError):
    """The two jobs could not form a transfer group: they disagree, or a rank never came."""


class TransferGroup:
    """The process group ``transfer_group`` returns: ``rank()``, ``size()`` and the
    collectives of a torch process group (``broadcast``, ``allgather``, ``allreduce``,
    ``barrier``, each taking a list of tensors and torch's options, returning a work),
    run by its gloo backend, or its NCCL backend for CUDA tensors. It is not in torch's
    registry, so ``torch.distributed.broadcast(group=...)`` does not take it. The backends
    are torch's own objects, called directly. (A Python subclass of ``ProcessGroup``, whose
    every call goes through pybind's override lookup, was tried first: in 3 of about 12 runs
    of the two-job tests a rank stayed inside its ``allgather`` call past every bound.)

    ``side`` / ``side_rank``: this process's job and rank in it; ``world_sizes``: (trainer
    ranks, engine ranks); ``trainer_ranks`` / ``engine_ranks``: their ranks in this group.
    ``dcp_group_key``: the group's name with its nonce, alike on every member and new for
    every group made (dcp-load keys its kept plans and call counts by it). ``close()`` shuts
    the group down and releases its kept plans, store and (on trainer rank 0) port.
    """

    def __init__(self, store: Any, rank: int, size: int, *, side: str, side_rank: int,
                 world_sizes: tuple[int, int], key: str, hosted: Any, where: str = ""):
        self._store, self._hosted = store, hosted  # the hosting rank keeps its server alive
        self._where = where  # host:port, for messages
        self._rank, self._size = rank, size
        self._backends: list[Any] = []  # gloo, then NCCL when asked
        self.side, self.side_rank, self.world_sizes = side, side_rank, world_sizes
        self.dcp_group_key = key

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        return "nccl" if len(self._backends) > 1 else "gloo"

    def get_group_store(self) -> Any:
        """The store transfer's helpers meet through; a closed group, or one whose server
        (trainer rank 0) is gone, raises ``TransferGroupError`` saying so."""
        if self._store is None:
            raise TransferGroupError(f"{self!r} is closed")
        try:
            self._store.check(["alive"])  # one round trip: the server answers, or is gone
        except dist.DistError as exc:
            raise TransferGroupError(
                f"transfer group {self.dcp_group_key!r} ({self.side} rank {self.side_rank}): trainer rank 0, which "
                f"serves the group's store at {self._where}, is gone (it failed or left): {type(exc).__name__}: "
                f"{exc}") from exc
        return self._store

    def _get_backend(self, device: Any) -> Any:
        if not self._backends:
            raise RuntimeError(f"{self!r} is closed")
        return self._backends[-1] if torch.device(device).type == "cuda" else self._backends[0]

    def _for(self, tensors: Any) -> Any:
        first = tensors[0]
        while isinstance(first, list):  # allgather's outputs: a list per input
            first = first[0]
        return self._get_backend(first.device)

    def broadcast(self, tensors: list[Any], opts: Any = None) -> Any:
        return self._for(tensors).broadcast(tensors, opts if opts is not None else dist.BroadcastOptions())

    def allgather(self, outputs: list[list[Any]], inputs: list[Any], opts: Any = None) -> Any:
        from torch.distributed.distributed_c10d import AllgatherOptions

        return self._for(inputs).allgather(outputs, inputs, opts if opts is not None else AllgatherOptions())

    def allreduce(self, tensors: list[Any], opts: Any = None) -> Any:
        return self._for(tensors).allreduce(tensors, opts if opts is not None else dist.AllreduceOptions())

    def barrier(self) -> Any:
        return self._get_backend("cpu").allreduce([torch.zeros(1)])

    @property
    def trainer_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world_sizes[0]))

    @property
    def engine_ranks(self) -> tuple[int, ...]:
        return tuple(range(self.world_sizes[0], sum(self.world_sizes)))

    def sides_text(self) -> str:
        """Which of the group's ranks are which job's, for messages."""
        t, e = self.world_sizes
        verb = "is" if t == 1 else "are"
        return (f"In transfer group {self.dcp_group_key!r}: {_span(0, t)} {verb} the trainer's {_span(0, t)}, "
                f"{_span(t, t + e)} the engine's {_span(0, e)}.")

    def close(self, timeout: float = 30.0) -> None:
        """Shut the group down, on every rank after its last transfer: its backends, its kept
        plans (with their broadcast groups) and, on trainer rank 0, its store's server and
        port. The ranks first wait for each other (at most ``timeout`` seconds; a dead peer
        only delays this): trainer rank 0 serves the store, and a peer still removing its
        last call's keys from it must not find it gone."""
        if not self._backends:
            return
        if self._hosted is not None:  # before the wait: a rank that rejoins at once finds no open group
            with contextlib.suppress(dist.DistError):
                self._hosted.delete_key(OPEN_KEY)
        self._closing(timeout)
        for backend in self._backends:
            backend.shutdown()
        self._backends.clear()
        from ._kept import forget_group
        from ._versions import forget_group as forget_count

        forget_group(self.dcp_group_key)
        forget_count(self.dcp_group_key)
        self._store = self._hosted = None  # the server (and its port) goes with the last reference

    def _closing(self, timeout: float) -> None:
        """Each rank counts itself in the store; trainer rank 0 (its server) waits until every
        rank did, at most ``timeout`` seconds. Through the store and not a collective: after a
        failed transfer the backends' queues hold broadcasts that never finish, and a
        collective queued behind them (and its work object, whose release waits for it) stays
        until the backend's own timeout (60 s measured after a trainer rank raised mid-delta)."""
        deadline = time.monotonic() + timeout
        with contextlib.suppress(dist.DistError):  # the server gone: nobody left to wait for
            count = self._store.add(CLOSING_KEY, 1)
            while self._hosted is not None and count < self._size and time.monotonic() < deadline:
                time.sleep(0.01)
                count = self._store.add(CLOSING_KEY, 0)

    def __repr__(self) -> str:
        return (f"TransferGroup({self.dcp_group_key!r}, {self.side} rank {self.side_rank}, rank {self.rank()} "
                f"of {self.size()}, world_sizes={self.world_sizes})")


def _span(lo: int, hi: int) -> str:
    return f"rank {lo}" if hi - lo == 1 else f"ranks {lo}-{hi - 1}"


@contextlib.contextmanager
def sides_named(group: Any) -> Iterator[None]:
    """A ``LoadError`` raised inside, within a ``TransferGroup``, also says which ranks are
    the trainer's and which the engine's (its messages name the group's rank numbers)."""
    try:
        yield
    except LoadError as exc:
        if isinstance(group, TransferGroup) and exc.args:
            exc.args = (f"{exc.args[0]}\n{group.sides_text()}", *exc.args[1:])
        raise


def _check_arguments(side: Any, rank: Any, world_sizes: Any, backend: Any, name: Any) -> tuple[int, int]:
    if side not in SIDES:
        raise ValueError(f"transfer_group: side must be 'trainer' or 'engine', got {side!r}")
    try:
        sizes = tuple(int(w) for w in world_sizes)
    except (TypeError, ValueError):
        sizes = ()
    if len(sizes) != 2 or min(sizes) < 1 or any(isinstance(w, bool) for w in world_sizes):
        raise ValueError(f"transfer_group ({side} rank {rank}): world_sizes must be (trainer ranks, engine ranks), "
                         f"two ints >= 1, got {world_sizes!r}")
    mine = sizes[SIDES.index(side)]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < mine:
        raise ValueError(f"transfer_group: rank must be this process's rank in the {side} job, an int in "
                         f"[0, {mine}) for world_sizes={sizes}, got {rank!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"transfer_group ({side} rank {rank}): backend must be 'gloo' or 'nccl', got {backend!r}")
    if not isinstance(name, str) or not name or "/" in name:
        raise ValueError(f"transfer_group ({side} rank {rank}): name must be a non-empty str without '/', "
                         f"got {name!r}")
    return sizes[0], sizes[1]


def _seconds(timeout: Any) -> float:
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0:
        raise ValueError(f"transfer_group: timeout must be a datetime.timedelta or a number of seconds > 0, "
                         f"got {timeout!r}")
    return float(seconds)


def _host(host: str, port: int, seconds: float, who: str, name: str) -> tuple[Any, str]:
    """Serve the store on ``port`` (trainer rank 0) and open the group there under a fresh
    nonce: (the server, the nonce)."""
    try:
        server = dist.TCPStore(host, port, None, True, timedelta(seconds=seconds), wait_for_workers=False)
    except Exception as exc:  # noqa: BLE001 - the store's own errors name neither the side nor the group
        taken = "address already in use" in str(exc).lower() or getattr(exc, "errno", None) == errno.EADDRINUSE
        why = (f"port {port} is taken by another process or by a transfer group not closed yet (a port serves "
               "one group at a time: close() the earlier group, or give each group its own port); ") if taken else ""
        raise TransferGroupError(f"transfer_group {name!r} ({who}): could not host the store on {host}:{port}: "
                                 f"{why}{type(exc).__name__}: {exc}") from exc
    nonce = uuid.uuid4().hex
    server.set(OPEN_KEY, encode("open", {"name": name, "nonce": nonce}))
    return server, nonce


def _open_group(server: Any) -> dict[str, Any] | None:
    """The group open on ``server``, or None (one atomic read: a key missing reads as the
    expected value, which no group's entry equals)."""
    value = server.compare_set(OPEN_KEY, "-", "-")
    if value == b"-":
        return None
    body = decode(value, key=OPEN_KEY, kind="open")
    if not (isinstance(body, dict) and set(body) == {"name", "nonce"} and isinstance(body["name"], str)
            and isinstance(body["nonce"], str) and _NONCE.fullmatch(body["nonce"])):
        raise ControlMessageError(OPEN_KEY, "expected {'name': str, 'nonce': 32 hex digits}")
    return body


#: A group's nonce (``uuid4().hex``): it becomes part of every key of the group, so nothing else is taken.
_NONCE = re.compile(r"[0-9a-f]{32}")


def _reach(host: str, port: int, deadline: float, seconds: float, who: str, name: str) -> tuple[Any, str]:
    """Trainer rank 0's server at ``host:port`` once it has group ``name`` open, and that
    group's nonce. Attempts repeat until ``deadline``; a server that goes away (an earlier
    group's, closing) is reached again, so the new one is found once it is up."""
    server, last = None, "nothing answered"
    while True:
        opened = None
        try:
            if server is None:
                attempt = max(min((deadline - time.monotonic()) / 2, CONNECT_TRY_S), 0.05)
                # a plain connect first: refused at once while nothing listens, where torch's
                # client would retry after a random back-off of up to about 1.5 s, past the bound
                socket.create_connection((host, port), timeout=attempt).close()
                server = dist.TCPStore(host, port, None, False, timedelta(seconds=attempt), wait_for_workers=False)
                server.set_timeout(timedelta(seconds=seconds))
            opened = _open_group(server)
            last = "a store answered but has no transfer group open (an earlier group's, closing, or not a group's)"
        except ControlMessageError as exc:
            raise TransferGroupError(f"transfer_group {name!r} ({who}): {host}:{port} holds no transfer group "
                                     f"dcp wrote: {exc}") from exc
        except OSError:  # the plain connect: nothing listens yet
            server, last = None, "nothing listens there"
        except Exception as exc:  # noqa: BLE001 - not up yet, or gone: try again until the bound
            server, last = None, f"{type(exc).__name__}: {str(exc)[:200]}"
        if opened is not None and opened.get("name") != name:
            raise TransferGroupError(f"transfer_group {name!r} ({who}): {host}:{port} serves transfer group "
                                     f"{opened.get('name')!r}, not {name!r}: a port serves one group at a time; "
                                     "give each group its own port")
        if opened is not None:
            return server, opened["nonce"]
        if time.monotonic() >= deadline:
            raise TransferGroupError(f"transfer_group {name!r} ({who}): trainer rank 0 did not open the group at "
                                     f"{host}:{port} within {seconds:g} s ({last}); start every rank of both jobs "
                                     "with the same host, port and name")
        time.sleep(POLL_S)


def _greeting(name: str, side: str, rank: int, sizes: tuple[int, int], backend: str) -> dict[str, Any]:
    from .._version import __version__

    return {"protocol": PROTOCOL, "dcp_load": __version__, "name": name, "side": side, "rank": rank,
            "world_sizes": list(sizes), "backend": backend}


def _await(store: Any, keys: Sequence[str], deadline: float, seconds: float, who: str) -> list[dict[str, Any]]:
    """The greetings under ``keys`` once all are there; names the missing ones at ``deadline``."""
    pending = list(keys)
    while pending:
        pending = [k for k in pending if not store.check([k])]
        if not pending:
            break
        if time.monotonic() >= deadline:
            names = ", ".join(k.replace("/", " rank ") for k in pending)
            raise TransferGroupError(f"transfer_group ({who}): {names} did not join within {seconds:g} s; start "
                                     "every rank of both jobs with the same host, port and name")
        time.sleep(POLL_S)
    return [_hello(store.get(k), k, who) for k in keys]


#: A greeting's fields and their types (``_greeting``); anything else is not a greeting.
_HELLO = {"protocol": int, "dcp_load": str, "name": str, "side": str, "rank": int, "world_sizes": list,
          "backend": str}


def _hello(raw: Any, key: str, who: str) -> dict[str, Any]:
    """The greeting under ``key``, checked field by field; ``TransferGroupError`` naming the
    key when it is not one (another process wrote it)."""
    try:
        body = decode(raw, key=key, kind="hello")
        if not isinstance(body, dict) or set(body) != set(_HELLO):
            raise ControlMessageError(key, f"a greeting has exactly the fields {sorted(_HELLO)}")
        bad = [f for f, t in _HELLO.items() if not isinstance(body[f], t) or isinstance(body[f], bool)]
        sizes = body["world_sizes"] if "world_sizes" not in bad else []
        if bad or len(sizes) != 2 or not all(isinstance(w, int) and not isinstance(w, bool) for w in sizes) \
                or body["side"] not in SIDES or key != f"{body['side']}/{body['rank']}":
            raise ControlMessageError(key, f"not a well-formed greeting for {key!r} (fields of the wrong type: "
                                           f"{bad or 'side, rank or world_sizes'})")
    except ControlMessageError as exc:
        raise TransferGroupError(f"transfer_group ({who}): {exc}") from exc
    return body


_COMPARED = ("protocol", "dcp_load", "world_sizes", "backend")


def _disagreements(mine: dict[str, Any], others: Sequence[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """What the ``others`` say that differs from ``mine``, and the fields that differ."""
    said, fields = [], []
    for other in others:
        for field in _COMPARED:
            if other.get(field) != mine[field]:
                said.append(f"{other.get('side')} rank {other.get('rank')} says {field}={other.get(field)!r}")
                fields.append(field)
    return said, list(dict.fromkeys(fields))


def _claim(store: Any, hello: dict[str, Any], who: str) -> None:
    """Claim this (side, rank) in this group: a second process passing the same is refused."""
    if store.add(f"claim/{hello['side']}/{hello['rank']}", 1) > 1:
        raise TransferGroupError(f"transfer_group {hello['name']!r} ({who}): another process already joined this "
                                 f"group as {who}; every process of a job must pass its own rank")
    store.add("arrived", 1)


def _handshake(store: Any, hello: dict[str, Any], sizes: tuple[int, int], deadline: float, seconds: float,
               who: str) -> None:
    _claim(store, hello, who)
    store.set(f"{hello['side']}/{hello['rank']}", encode("hello", hello))
    for keys in (["trainer/0", "engine/0"],
                 [f"{s}/{r}" for s, n in zip(SIDES, sizes, strict=True) for r in range(n)]):
        said, fields = _disagreements(hello, _await(store, keys, deadline, seconds, who))
        if said:
            here = ", ".join(f"{f}={hello[f]!r}" for f in fields)
            raise TransferGroupError(f"transfer_group {hello['name']!r} ({who}): the jobs disagree: "
                                     f"{'; '.join(dict.fromkeys(said))}; {who} (this rank) has {here}; every rank of "
                                     "both jobs must pass the same world_sizes=(trainer ranks, engine ranks) and "
                                     "backend, with the same dcp-load version")


def _handshake_once(store: Any, hello: dict[str, Any], sizes: tuple[int, int], deadline: float, seconds: float,
                    who: str, hosting: bool) -> None:
    """``_handshake``; on failure the hosting rank keeps the store up until every rank that
    arrived has failed too (at most ``LINGER_S``), so that each reads the disagreement
    itself rather than a store that went away; a lost store is named as such."""
    try:
        _handshake(store, hello, sizes, deadline, seconds, who)
    except TransferGroupError:
        _leave(store, hosting, min(seconds, LINGER_S))
        raise
    except dist.DistError as exc:
        raise TransferGroupError(f"transfer_group ({who}): trainer rank 0's store went away during the handshake "
                                 f"(that rank failed or left): {type(exc).__name__}: {exc}") from exc


def _leave(store: Any, hosting: bool, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    try:
        left = store.add("failed", 1)
        while hosting and left < store.add("arrived", 0) and time.monotonic() < deadline:
            time.sleep(POLL_S)
            left = store.add("failed", 0)
    except dist.DistError:
        pass  # the store is gone: nothing to keep up


def _backends(group: TransferGroup, store: Any, rank: int, size: int, backend: str, seconds: float) -> None:
    """Gloo for host tensors (and the control messages), NCCL for CUDA tensors when asked."""
    timeout = timedelta(seconds=seconds)
    group._backends.append(dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group._backends.append(dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts))


def transfer_group(host: str, port: int, *, side: str, rank: int, world_sizes: Sequence[int],
                   timeout: Any = 300.0, backend: str = "gloo", name: str = "weights") -> TransferGroup:
    """Join this process to the weight-sync group of a trainer job and an engine job.

    Call it on every rank of both jobs with the same ``host``, ``port``, ``world_sizes``
    ((trainer ranks, engine ranks)), ``backend`` and ``name``; ``side`` is ``"trainer"`` or
    ``"engine"``, ``rank`` this process's rank in its own job. Trainer rank 0 hosts a
    ``TCPStore`` on ``port``; the group's ranks are the trainer's ``0..T-1`` then the
    engine's ``T..T+E-1``. Neither job's default process group is used or changed.
    ``backend="nccl"`` adds NCCL for CUDA tensors (gloo stays for host tensors and control).

    Jobs that disagree (world sizes, backend, dcp-load version) raise ``TransferGroupError``
    on every rank, naming the sides, ranks and values; a rank missing after ``timeout``
    (seconds or a ``timedelta``; also the group's collective timeout) is named the same way.
    Pass the result as ``transfer(..., process_group=group)``; ``close()`` it on every rank
    after the last transfer, after which a group can be made again on the same port (a
    side that restarted rejoins the other this way).
    """
    sizes = _check_arguments(side, rank, world_sizes, backend, name)
    seconds = _seconds(timeout)
    deadline = time.monotonic() + seconds
    who = f"{side} rank {rank}"
    hosting = side == "trainer" and rank == 0
    if hosting:
        server, nonce = _host(host, int(port), seconds, who, name)
    else:
        server, nonce = _reach(host, int(port), deadline, seconds, who, name)
    store = dist.PrefixStore(f"dcp-sync/{name}/{nonce}/", server)  # this group's keys only
    _handshake_once(store, _greeting(name, side, rank, sizes, backend), sizes, deadline, seconds, who, hosting)
    me = rank if side == "trainer" else sizes[0] + rank
    group = TransferGroup(dist.PrefixStore("group/", store), me, sum(sizes), side=side, side_rank=rank,
                          world_sizes=sizes, key=f"transfer-group:{name}@{host}:{port}#{nonce[:12]}",
                          hosted=server if hosting else None, where=f"{host}:{port}")
    try:
        _backends(group, store, me, sum(sizes), backend, seconds)
    except Exception as exc:  # noqa: BLE001 - gloo's connect errors name neither side nor group
        raise TransferGroupError(f"transfer_group {name!r} ({who}): connecting the {backend} group of "
                                 f"{sum(sizes)} ranks failed: {type(exc).__name__}: {exc}") from exc
    return group
