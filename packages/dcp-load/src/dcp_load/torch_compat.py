"""A stand-in for ``torch.distributed.checkpoint`` in an existing import.

Code written for torch DCP switches by changing one import::

    import dcp_load.torch_compat as dcp        # was: import torch.distributed.checkpoint as dcp

    dcp.save(state_dict, checkpoint_id=path, process_group=pg)
    future = dcp.async_save(state_dict, storage_writer=dcp.FileSystemWriter(path),
                            async_checkpointer_type=dcp.state_dict_saver.AsyncCheckpointerType.PROCESS)
    dcp.load(state_dict, storage_reader=dcp.HuggingFaceStorageReader(hf_dir))

``save``, ``async_save`` and ``load`` take torch DCP's arguments with torch's meaning
(``storage_reader``/``storage_writer``, ``planner``, ``process_group``, ``no_dist``,
``use_collectives``, ``async_checkpointer_type``, ``async_stager``) and Stateful values, and
run dcp's ``save``/``async_save``/``load`` (docs/from-torch-dcp.md). ``state_dict_saver`` and ``state_dict_loader`` hold the
same functions under torch's module names. Every other name (``FileSystemReader``,
``DefaultLoadPlanner``, ``Metadata``, ``stateful``...) is torch DCP's own, looked up there on
first use, so torch is imported only when this module is.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from ._errors import LoadError
from ._load import load as _load
from .layouts._stateful import is_stateful
from .saving._async import async_save as _async_save
from .saving._future import SaveFuture
from .saving._rank_values import with_other_ranks_values
from .saving._save import save as _save

__all__ = ["async_save", "load", "save", "state_dict_loader", "state_dict_saver"]

_PathLike = str | os.PathLike[str] | None


def _checkpoint_exception_class(base: type[LoadError]) -> type:
    """``base`` and torch DCP's ``CheckpointException`` in one class (made once, on the first
    failure), so that callers catching either catch dcp's errors. ``failures``, the message and
    pickling stay ``base``'s: ``failures`` maps each rank to its causes (text), where torch's
    maps it to an (exception, traceback) pair."""
    from torch.distributed.checkpoint.api import CheckpointException

    if issubclass(base, CheckpointException):
        return base
    return type(base.__name__, (base, CheckpointException), {
        "__module__": base.__module__, "__qualname__": base.__qualname__,
        "__doc__": f"{base.__doc__}\n\nRaised by ``dcp_load.torch_compat``: a ``CheckpointException`` too.",
        # CheckpointException's property would hide the instance's own failures
        "failures": property(lambda self: self.__dict__["failures"],
                             lambda self, value: self.__dict__.__setitem__("failures", value)),
        "__str__": BaseException.__str__,
        "__reduce__": lambda self: _reduced(self, base)})


_exception_class = functools.cache(_checkpoint_exception_class)


def _reduced(error: LoadError, base: type[LoadError]) -> tuple[Any, ...]:
    """How ``error`` (of a class ``_checkpoint_exception_class`` made) pickles: as ``base``
    does, rebuilt as torch_compat raised it."""
    make, args, *_ = base.__reduce__(error)
    return _as_checkpoint_exception, (base if make is type(error) else make, args)


def _as_checkpoint_exception(make: Any, args: tuple[Any, ...]) -> LoadError:
    """A ``LoadError`` rebuilt by ``make(*args)``, as torch_compat raises it."""
    error = make(*args)
    error.__class__ = _exception_class(type(error))
    return error


def _raises_checkpoint_exception(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, whose ``LoadError`` is also a torch DCP ``CheckpointException``: the same
    object, with its traceback and attributes, its class swapped for one deriving from both."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except LoadError as error:
            error.__class__ = _exception_class(type(error))
            raise

    return wrapper


@_raises_checkpoint_exception
def save(state_dict: Mapping[str, Any], *, checkpoint_id: _PathLike = None, storage_writer: Any = None,
         planner: Any = None, process_group: Any = None, no_dist: bool = False,
         use_collectives: bool = True) -> Any:
    """torch DCP's ``save``: dcp's ``save`` writing torch DCP's own format (``.metadata`` and
    ``.distcp`` files, which torch's readers and tools read); returns its ``SaveReport``
    (torch returns the checkpoint's ``Metadata``, which callers rarely use). Non-tensor
    values are pickled and, as torch stores them, taken from whichever rank holds them
    (``saving/_rank_values.py``: dcp alone stores rank 0's)."""
    state_dict = with_other_ranks_values(state_dict, process_group, no_dist)
    return _save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                 process_group=process_group, no_dist=no_dist, use_collectives=use_collectives, allow_pickle=True,
                 format="torch_dcp")


@_raises_checkpoint_exception
def async_save(state_dict: Mapping[str, Any], *, checkpoint_id: _PathLike = None, storage_writer: Any = None,
               planner: Any = None, process_group: Any = None, async_checkpointer_type: Any = None,
               async_stager: Any = None, no_dist: bool = False, use_collectives: bool = True) -> Any:
    """torch DCP's ``async_save``: dcp's ``async_save`` writing torch DCP's own format, whose
    future also has torch's
    ``staging_completion`` and ``upload_completion``. Given a stager that stages in the
    background (``StagingOptions(use_async_staging=True)``), torch returns an
    ``AsyncSaveResponse`` instead of a future, and so does this (torchtitan's pinned-memory
    mode checks for one); its futures are dcp's, whose failure is a ``CheckpointException``
    too, as torch's future raises."""
    state_dict = with_other_ranks_values(state_dict, process_group, no_dist)
    future = _async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                         process_group=process_group, async_checkpointer_type=async_checkpointer_type,
                         async_stager=async_stager, no_dist=no_dist, use_collectives=use_collectives,
                         allow_pickle=True, format="torch_dcp")
    _fails_with_checkpoint_exception(future)
    if not _stages_in_background(async_stager):
        return future
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

    return AsyncSaveResponse(staging_completion=future.staging_completion, upload_completion=future)


class _CompatSaveFuture(SaveFuture):
    """``async_save``'s future, whose failure (a ``LoadError``) is also torch DCP's
    ``CheckpointException``, as torch's future raises."""

    def set_exception(self, exception: BaseException | None) -> None:
        if isinstance(exception, LoadError):
            exception.__class__ = _exception_class(type(exception))
        super().set_exception(exception)


def _fails_with_checkpoint_exception(future: SaveFuture) -> None:
    """Make ``future``'s failure a ``CheckpointException`` too, whether the background save
    fails after this or failed already (its exception's class swapped in place, without
    marking the failure as seen: an unread failure is still logged)."""
    if type(future) is not SaveFuture:
        return
    future.__class__ = _CompatSaveFuture
    if future.done() and not future.cancelled():
        error = Future.exception(future, 0)
        if isinstance(error, LoadError):
            error.__class__ = _exception_class(type(error))


def _stages_in_background(stager: Any) -> bool:
    """Whether torch's ``async_save`` would return an ``AsyncSaveResponse`` for this stager:
    its ``stage`` returns a future, which torch's ``DefaultStager`` does when its
    ``StagingOptions.use_async_staging`` is set (read from the stager's options, since dcp
    never calls ``stage``: it copies what this rank writes itself)."""
    options = getattr(stager, "_config", None)
    return bool(getattr(options, "use_async_staging", False))


@_raises_checkpoint_exception
def load(state_dict: dict[str, Any], *, checkpoint_id: _PathLike = None, storage_reader: Any = None,
         planner: Any = None, process_group: Any = None, no_dist: bool = False) -> None:
    """torch DCP's ``load``: dcp's ``load`` fills a shallow copy of ``state_dict`` whose keys
    are sorted (each Stateful's ``load_state_dict`` is called), then, as torch does, puts
    every other top-level value back with ``state_dict[key] = value`` in sorted key order
    (a tensor filled in place, a replaced int or string); returns None, as torch's does."""
    if not isinstance(state_dict, Mapping):  # refused by load, naming the type
        keys, filled = [], state_dict
    else:
        keys = _sorted_keys(state_dict)
        filled = {key: state_dict[key] for key in keys}
    _load(filled, checkpoint_id=checkpoint_id, storage_reader=storage_reader, planner=planner,
          process_group=process_group, no_dist=no_dist, allow_pickle=True)
    for key in keys:
        if key in state_dict and not is_stateful(state_dict[key]):
            state_dict[key] = filled[key]


def _sorted_keys(state_dict: Mapping[Any, Any]) -> list[Any]:
    """torch DCP's ``sorted(state_dict.keys())``; keys of several types by their text."""
    try:
        return sorted(state_dict.keys())
    except TypeError:
        return sorted(state_dict.keys(), key=str)


def _torch_module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"torch.distributed.checkpoint.{name}")


class _Namespace(types.ModuleType):
    """torch's ``state_dict_saver`` / ``state_dict_loader`` with dcp's functions in front."""

    def __init__(self, name: str, **functions: Any):
        super().__init__(f"{__name__}.{name}")
        self._torch_name = name
        self.__dict__.update(functions)

    def __getattr__(self, attr: str) -> Any:
        return getattr(_torch_module(self._torch_name), attr)


state_dict_saver = _Namespace("state_dict_saver", save=save, async_save=async_save)
state_dict_loader = _Namespace("state_dict_loader", load=load)


def __getattr__(name: str) -> Any:
    import torch.distributed.checkpoint as tdcp

    try:
        return getattr(tdcp, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (nor has "
                             "torch.distributed.checkpoint)") from None
