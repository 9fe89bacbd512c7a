"""torch.distributed.checkpoint's arguments, taken with their torch meaning.

A caller of torch DCP passes its storage readers and writers, its planners and its async
options; ``load``, ``save`` and ``async_save`` accept them so that switching is a change of
import (docs/from-torch-dcp.md):

* ``storage_reader``: torch's ``FileSystemReader``, ``HuggingFaceStorageReader`` and
  ``FsspecReader`` are served from the path they hold (dcp detects the format there);
  a ``dcp_reader.CheckpointReader`` is used as it is; any other class (a reader that
  transforms what it reads, such as ``QuantizedHuggingFaceStorageReader``) is refused,
  naming it.
* ``storage_writer``: torch's ``FileSystemWriter`` and ``FsspecWriter``: dcp writes into
  their path (the format ``format=`` names; ``torch_compat`` asks for torch's); their options
  are honoured or refused by name (``writer_options``: ``_extensions=[ZStandard()]`` writes
  torch's format zstd-compressed, as torch does); others (``HuggingFaceStorageWriter``:
  Hugging Face files) are refused, naming the class and what to do instead.
* ``planner``: torch's ``DefaultLoadPlanner`` (``allow_partial_load=True`` is
  ``strict=False``) and ``DefaultSavePlanner`` (dcp writes each replicated box once, as its
  dedup does) are accepted; a subclass or another planner is refused, naming it, since its
  overrides would be ignored. A ``dcp_load.Planner`` is passed on.

A refusal is a ``TypeError`` or ``ValueError`` raised before any rank waits: ``load`` and
``save`` tell the other ranks at once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

__all__ = ["NATIVE", "WriterOptions", "load_arguments", "load_source", "save_arguments", "save_planner", "save_target",
           "strictness", "writer_options"]

#: ``save(format=...)`` names and the dcp-reader format each writes
FORMATS = {"native": "native", "torch_dcp": "torch-dcp", "torch-dcp": "torch-dcp"}


@dataclass(frozen=True)
class WriterOptions:
    """What a save writes: the format (``"native"`` or ``"torch-dcp"``), whether an
    existing checkpoint may be replaced (torch's ``FileSystemWriter(overwrite=...)``) and the
    transforms applied to every stored item (torch-dcp: ``("stream.zstd/1",)``, from
    ``_extensions=[ZStandard()]``)."""

    format: str = "native"
    overwrite: bool = True
    transforms: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        """The format and its transforms, which every rank of a save must agree on."""
        return "+".join((self.format, *self.transforms))

    def writer(self, path: str, allow_pickle: bool) -> Any:
        """The dcp-reader writer of this format into ``path``."""
        if self.format == "torch-dcp":
            from dcp_reader.write import TorchDcpWriter

            return TorchDcpWriter(path, allow_pickle=allow_pickle, transforms=self.transforms)
        from dcp_reader import NativeWriter

        return NativeWriter(path, allow_pickle=allow_pickle)

    def data_file_name(self, rank: int, save_id: str) -> str:
        """The name of rank ``rank``'s data file in the save ``save_id`` (the same on every rank)."""
        if self.format == "torch-dcp":
            from dcp_reader.write import TorchDcpWriter

            return TorchDcpWriter.data_file_name(rank, save_id)
        from dcp_reader import data_file_name

        return data_file_name(rank, save_id)


NATIVE = WriterOptions()

#: torch's readers whose files dcp reads itself, from the path they hold.
_READERS = {"FileSystemReader", "HuggingFaceStorageReader", "FsspecReader", "_FileSystemReader"}
_WRITERS = {"FileSystemWriter", "FsspecWriter", "_FileSystemWriter"}


def _torch_class(obj: Any) -> str | None:
    """The class name of a torch.distributed.checkpoint object, or None for another's."""
    module = type(obj).__module__ or ""
    return type(obj).__name__ if module.startswith("torch.distributed.checkpoint") else None


def _qualname(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def load_source(checkpoint_id: Any, storage_reader: Any) -> tuple[Any, Any]:
    """(checkpoint_id, storage_reader) as ``load`` serves them: a torch reader becomes the
    path it holds (torch's rule: a ``checkpoint_id`` given too wins)."""
    if storage_reader is None or hasattr(storage_reader, "read_into"):  # a dcp_reader.CheckpointReader
        return checkpoint_id, storage_reader
    name = _torch_class(storage_reader)
    if name not in _READERS:
        raise TypeError(
            f"load: storage_reader= of class {_qualname(storage_reader)} cannot be served: dcp reads "
            "checkpoints itself, from the path of torch's FileSystemReader, HuggingFaceStorageReader or "
            "FsspecReader (or a dcp_reader.CheckpointReader); pass checkpoint_id=<the checkpoint directory> "
            "instead (a reader that changes what it reads, such as a dequantizing one, has no dcp equivalent)")
    return (checkpoint_id if checkpoint_id is not None else _path_of(storage_reader, "storage_reader")), None


def save_target(checkpoint_id: Any, storage_writer: Any, what: str) -> Any:
    """The directory a save writes: ``checkpoint_id``, else the path of torch's writer."""
    if storage_writer is None:
        return checkpoint_id
    name = _torch_class(storage_writer)
    if name == "HuggingFaceStorageWriter":
        raise TypeError(
            f"{what}: storage_writer=HuggingFaceStorageWriter asks for Hugging Face safetensors files, which {what} "
            "does not write (it writes dcp's native format: safetensors data files with a JSON index, which "
            "dcp_load.load reads). Save with checkpoint_id=, then convert: dcp_load.convert(src, dst, to='hf') "
            "or `dcp convert SRC DST --to hf`")
    if name not in _WRITERS:
        raise TypeError(
            f"{what}: storage_writer= of class {_qualname(storage_writer)} cannot be served: dcp writes its own "
            "files, into the path of torch's FileSystemWriter or FsspecWriter; pass checkpoint_id=<directory>")
    return checkpoint_id if checkpoint_id is not None else _path_of(storage_writer, "storage_writer")


def _path_of(obj: Any, what: str) -> str:
    path = getattr(obj, "path", None)
    if path is None:
        raise TypeError(f"{what}= of class {_qualname(obj)} holds no path; pass checkpoint_id=")
    return os.fspath(path) if not isinstance(path, str) else path


def strictness(planner: Any, strict: bool) -> tuple[Any, bool]:
    """(the dcp planner, strict) for ``load``'s ``planner=``: torch's ``DefaultLoadPlanner``
    is dcp's default planner, its ``allow_partial_load=True`` being ``strict=False``."""
    if planner is None or hasattr(planner, "assign"):  # dcp_load.Planner
        return planner, strict
    if type(planner).__name__ == "DefaultLoadPlanner" and _torch_class(planner):
        if not getattr(planner, "flatten_state_dict", True):
            raise ValueError("load: planner=DefaultLoadPlanner(flatten_state_dict=False) is not supported: dcp "
                             "flattens nested state dicts as torch DCP does by default; drop the argument")
        return None, strict and not getattr(planner, "allow_partial_load", False)
    raise TypeError(
        f"load: planner= of class {_qualname(planner)} is not supported: dcp plans reads itself (torch's "
        "DefaultLoadPlanner is accepted, allow_partial_load=True meaning strict=False; a dcp_load.Planner "
        "chooses the reader of replicated boxes); a torch planner subclass's overrides would be ignored")


def save_planner(planner: Any, what: str) -> None:
    """Refuse a save ``planner=`` other than torch's ``DefaultSavePlanner``."""
    if planner is None or (type(planner).__name__ == "DefaultSavePlanner" and _torch_class(planner)):
        return
    raise TypeError(
        f"{what}: planner= of class {_qualname(planner)} is not supported: dcp chooses one writer per distinct "
        "box itself (torch's DefaultSavePlanner is accepted, its dedup being what dcp does); a planner "
        "subclass's overrides would be ignored")


def load_arguments(checkpoint_id: Any, storage_reader: Any, planner: Any, strict: bool) -> tuple[Any, Any, Any, bool]:
    """``load``'s (checkpoint_id, storage_reader, planner, strict) with torch's readers and
    planners taken as the module docstring says."""
    checkpoint_id, storage_reader = load_source(checkpoint_id, storage_reader)
    planner, strict = strictness(planner, strict)
    return checkpoint_id, storage_reader, planner, strict


def save_arguments(checkpoint_id: Any, storage_writer: Any, planner: Any, use_collectives: bool, no_dist: bool,
                   what: str) -> Any:
    """The directory ``save``/``async_save`` write, from torch's arguments (module docstring)."""
    save_planner(planner, what)
    if not use_collectives and not no_dist:
        raise ValueError(f"{what}: use_collectives=False without no_dist=True is not supported: dcp's ranks save one "
                         "checkpoint together (one writer per box, rank 0 commits the metadata); pass no_dist=True "
                         "with a directory of each rank's own to save without collectives")
    return save_target(checkpoint_id, storage_writer, what)


# What dcp does instead of each torch FileSystemWriter option it accepts without a setting of
# its own (docs/from-torch-dcp.md): every file is synced before the
# metadata is written (the commit order needs it); each writing rank writes one file, in one
# sequential stream; the staging pool of async_save is kept from save to save.
_DONE_OTHERWISE = ("sync_files", "single_file_per_rank", "thread_count", "per_thread_copy_ahead",
                   "cache_staged_state_dict")


def writer_options(storage_writer: Any, format: str, what: str) -> WriterOptions:  # noqa: A002
    """The format and options a save writes with: ``format`` (a name of ``FORMATS``) and
    torch's ``FileSystemWriter`` options, each honoured (``overwrite``,
    ``serialization_format=TORCH_SAVE``) or done otherwise (``_DONE_OTHERWISE``); an option dcp
    cannot honour is refused by name (ValueError), before anything is written."""
    if not isinstance(format, str) or format not in FORMATS:
        raise ValueError(f"{what}: format={format!r} is not a format dcp writes; pass one of "
                         f"{sorted(set(FORMATS) - {'torch-dcp'})}")
    fmt = FORMATS[format]
    if storage_writer is None or _torch_class(storage_writer) not in _WRITERS:
        return WriterOptions(fmt)
    serialization = getattr(getattr(storage_writer, "serialization_format", None), "value", "torch_save")
    if serialization != "torch_save":
        raise ValueError(f"{what}: storage_writer has serialization_format={serialization!r}, which dcp does not "
                         "write: pass SerializationFormat.TORCH_SAVE (torch's default, which every torch release "
                         "reads), or save in dcp's native format (safetensors data files)")
    return WriterOptions(fmt, overwrite=bool(getattr(storage_writer, "overwrite", True)),
                         transforms=_transforms(storage_writer, fmt, what))


def _transforms(storage_writer: Any, fmt: str, what: str) -> tuple[str, ...]:
    """The transform descriptors of the writer's ``_extensions``: none, or torch's one
    ``ZStandard()`` in torch DCP's format (``("stream.zstd/1",)``, its ``zstandard`` module
    installed); anything else refused by name before anything is written."""
    extensions = tuple(getattr(getattr(storage_writer, "transforms", None), "extensions", ()) or ())
    if not extensions:
        return ()
    names = [type(e).__name__ for e in extensions]
    if names != ["ZStandard"] or _torch_class(extensions[0]) != "ZStandard":
        raise ValueError(f"{what}: storage_writer has _extensions={names}, which dcp does not apply: nothing was "
                         "written. dcp applies torch's ZStandard() alone; save with _extensions=[ZStandard()] or "
                         "without _extensions (torch's readers read uncompressed files as well)")
    if fmt != "torch-dcp":
        raise ValueError(f"{what}: storage_writer has _extensions=['ZStandard'], which applies to torch DCP's format: "
                         "nothing was written. Pass format='torch_dcp' (dcp_load.torch_compat does), or drop "
                         "_extensions for dcp's native format")
    from dcp_reader.formats._zstd_frames import ZSTD_DESCRIPTOR
    from dcp_reader.write._zstd_blobs import check_transforms_written

    return check_transforms_written((ZSTD_DESCRIPTOR,))
