"""``save`` never destroys the checkpoint already in the directory, in one process: every
refusal (a value JSON cannot hold, one beyond its serialiser, a Chunk that does not tile,
a second writer, a sibling rank's no_dist save) comes before anything is touched; a
failed write (a disk that fills: a real EFBIG in a subprocess) leaves the old checkpoint
whole and removes the new files; an overwrite removes only the files the new metadata does
not name and that the native writer names; ``dcp verify`` reports stray and missing files.
Destinations are poisoned before each load."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import dcp_load
import pytest
import torch
from dcp_load import Chunk, LoadError
from dcp_load.cli._main import main as cli
from dcp_reader import METADATA_FILE, NativeWriter, WriterLockError, verify_checkpoint

LOCK = ".dcp-save.lock"


def _state(gen: int) -> dict:
    g = torch.Generator().manual_seed(gen)
    return {"w": torch.randn(8, 4, generator=g), "b": torch.randn(3, generator=g), "step": gen,
            "sched": {"lr": 0.1 * gen, "betas": (0.9, 0.99)}}


def _poisoned() -> dict:
    return {"w": torch.full((8, 4), float("nan")), "b": torch.full((3,), float("nan")), "step": None,
            "sched": {"lr": None, "betas": None}}


def _assert_holds(path, gen: int) -> None:
    got, want = _poisoned(), _state(gen)
    dcp_load.load(got, checkpoint_id=path, no_dist=True)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    assert got["step"] == gen and got["sched"] == want["sched"]
    assert verify_checkpoint(path).ok, verify_checkpoint(path).problems


def _listing(path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path)) if n != LOCK}


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "ckpt"
    dcp_load.save(_state(1), checkpoint_id=path)
    return path


class Schedule:  # a value JSON cannot hold (module level, so that pickle can)
    pass


@pytest.mark.parametrize(("bad", "match"), [
    ({"sched": Schedule()}, r"'sched': .*Schedule.*allow_pickle=True"),
    ({"big": 10 ** 5000}, r"'big': ValueError: .*4300"),
    ({"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]] * 1}, None),
    ({"w": Chunk(torch.zeros(2, 4), (8, 4), (0, 0))}, "do not tile"),
    ({"w": Chunk(torch.zeros(8, 4), (9, 4), (0, 0))}, "do not tile"),
])
def test_a_refused_save_touches_nothing(saved, bad, match):
    before = _listing(saved)
    state = {**_state(2), **bad}
    if match is None:  # a deep but storable list: saves (the check decodes it back), then is restored
        dcp_load.save(state, checkpoint_id=saved)
        got = {**_poisoned(), "deep": None}
        dcp_load.load(got, checkpoint_id=saved)
        assert got["deep"] == bad["deep"]
        return
    with pytest.raises(LoadError, match=match):
        dcp_load.save(state, checkpoint_id=saved)
    assert _listing(saved) == before
    _assert_holds(saved, 1)


def test_a_value_nested_beyond_what_json_reads_back_is_named(saved):
    deep: tuple = ()
    for _ in range(5000):
        deep = (deep,)
    with pytest.raises(LoadError, match=r"'deep': RecursionError"):
        dcp_load.save({**_state(2), "deep": deep}, checkpoint_id=saved)
    _assert_holds(saved, 1)


def test_a_failed_write_keeps_the_old_checkpoint_and_removes_the_new_files(saved, monkeypatch):
    before = _listing(saved)
    real = NativeWriter.write_file

    def fill_disk(self, name, tensors):
        real(self, name, tensors)  # the data file is written, then the values file fails
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(NativeWriter, "write_file", fill_disk)
    with pytest.raises(LoadError, match="No space left on device"):
        dcp_load.save(_state(2), checkpoint_id=saved)
    assert _listing(saved) == before
    _assert_holds(saved, 1)


def test_a_disk_that_fills_keeps_the_old_checkpoint(saved):
    # RLIMIT_FSIZE makes every write past 64 KiB fail with EFBIG, as a full disk fails with
    # ENOSPC: a real failure from the kernel in the middle of the new data file.
    script = textwrap.dedent(f"""
        import resource, signal, torch, dcp_load
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            dcp_load.save({{"w": torch.ones(512, 512), "step": 2}}, checkpoint_id={str(saved)!r})
        except dcp_load.LoadError as e:
            print("REFUSED", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "File too large" in out.stdout, out.stdout + out.stderr
    assert not [n for n in os.listdir(saved) if ".tmp-" in n]
    _assert_holds(saved, 1)


def test_an_overwrite_switches_at_once_and_removes_the_old_files(saved):
    old = set(os.listdir(saved))
    dcp_load.save(_state(2), checkpoint_id=saved)
    new = set(os.listdir(saved))
    assert not (old & new) - {METADATA_FILE, LOCK}  # every data file is new: the old stayed until the commit
    _assert_holds(saved, 2)


def test_an_overwrite_syncs_the_new_files_but_not_the_parent_again(tmp_path, monkeypatch):
    # the parent's fsync makes a directory the save created durable: a fresh save makes it,
    # a save into a directory that already holds committed metadata does not need it
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    path = tmp_path / "ckpt"
    dcp_load.save(_state(1), checkpoint_id=path)
    assert str(tmp_path) in synced, synced
    synced.clear()
    dcp_load.save(_state(2), checkpoint_id=path)
    assert str(tmp_path) not in synced, synced
    files = {os.path.basename(p) for p in synced if p.startswith(str(path) + os.sep)}
    assert any(".safetensors" in n for n in files) and any(METADATA_FILE in n for n in files), synced
    _assert_holds(path, 2)


def test_leftovers_are_reported_then_removed_by_the_next_save(saved, capsys):
    dcp_load.save({**_state(1), "sched": Schedule()}, checkpoint_id=saved, allow_pickle=True)
    pickles = [n for n in os.listdir(saved) if n.endswith(".pkl")]
    assert len(pickles) == 1
    # an earlier save by 4 ranks (names without a save id, as older versions wrote), a killed
    # save's temporary file, and a file that is not the writer's
    extra = ["rank-00001.safetensors", "rank-00003.0123456789ab.safetensors",
             "rank-00000.0123456789ab.safetensors.tmp-4242", "dcp-metadata.json.tmp-77"]
    for n in extra[1:] + ["notes.txt", "rank-1.safetensors"]:
        (saved / n).write_bytes(b"x" * 100)
    NativeWriter(saved).write_file(extra[0], {"w@0": torch.ones(2)})  # the name without an id: a native file
    report = verify_checkpoint(saved)
    assert not report.ok and sorted(p.split("'")[1] for p in report.problems) == sorted(extra)
    assert cli(["verify", str(saved)]) == 1
    out = capsys.readouterr().out
    assert out.count("PROBLEM stray file") == len(extra) and "4 problem(s)" in out

    dcp_load.save(_state(2), checkpoint_id=saved)  # no pickled value now: its file goes too
    left = set(os.listdir(saved))
    assert not left & set(extra + pickles) and {"notes.txt", "rank-1.safetensors"} <= left
    _assert_holds(saved, 2)


def test_a_missing_data_file_is_a_problem_that_names_it(saved, capsys):
    dcp_load.save({**_state(1), "sched": Schedule()}, checkpoint_id=saved, allow_pickle=True)
    data = next(n for n in os.listdir(saved) if n.endswith(".safetensors"))
    pickled = next(n for n in os.listdir(saved) if n.endswith(".pkl"))
    os.remove(saved / data)
    assert cli(["verify", str(saved)]) == 1
    out = capsys.readouterr().out
    assert f"PROBLEM missing file {data!r}" in out and "'b'; 'w'" in out and "1 problem(s)" in out
    os.remove(saved / pickled)
    report = verify_checkpoint(saved)
    assert len(report.problems) == 2 and pickled in report.problems[1] and "'sched'" in report.problems[1]


def test_a_second_writer_is_refused_naming_the_first(saved):
    before = _listing(saved)
    with NativeWriter(saved).lock():
        with pytest.raises(LoadError, match=rf"another save is writing into this checkpoint directory \(pid {os.getpid()}"):
            dcp_load.save(_state(2), checkpoint_id=saved)
        with pytest.raises(WriterLockError):
            NativeWriter(saved).lock()
    assert _listing(saved) == before
    _assert_holds(saved, 1)
    dcp_load.save(_state(3), checkpoint_id=saved)  # released: the next save proceeds
    _assert_holds(saved, 3)


def _launch(monkeypatch, rank: int, port: str = "29500") -> None:
    for k, v in {"WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                 "TORCHELASTIC_RUN_ID": "job"}.items():
        monkeypatch.setenv(k, v)


def test_no_dist_ranks_of_one_launch_cannot_share_a_directory(tmp_path, monkeypatch):
    path = tmp_path / "shared"
    _launch(monkeypatch, 0)
    with pytest.raises(RuntimeError, match=r"no_dist=True and a checkpoint_id of this rank's own"):
        dcp_load.save(_state(1), checkpoint_id=path)  # the advice of the launcher check is safe
    dcp_load.save(_state(1), checkpoint_id=path, no_dist=True)
    _launch(monkeypatch, 1)
    with pytest.raises(LoadError, match=r"saved by rank 0 of this launch .* this is rank 1"):
        dcp_load.save(_state(2), checkpoint_id=path, no_dist=True)
    _assert_holds(path, 1)  # rank 0's tensors are still there
    dcp_load.save(_state(2), checkpoint_id=tmp_path / "rank-1", no_dist=True)  # its own directory: fine
    _launch(monkeypatch, 0)
    dcp_load.save(_state(3), checkpoint_id=path, no_dist=True)  # the same rank again: an overwrite
    _assert_holds(path, 3)
    _launch(monkeypatch, 1, port="29611")  # another launch
    dcp_load.save(_state(4), checkpoint_id=path, no_dist=True)
    _assert_holds(path, 4)


def test_a_filesystem_without_locks_still_saves(saved, monkeypatch, caplog):
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    dcp_load.save(_state(2), checkpoint_id=saved)
    assert "does not support file locks" in caplog.text
    _assert_holds(saved, 2)


def test_two_ranks_of_a_launch_saving_with_no_dist_into_one_directory(tmp_path):
    # what torchrun does without init_process_group, after following the advice: both ranks
    # start together; whether their saves overlap (the lock) or not (the launch record),
    # exactly one is refused and the directory holds the other's tensors, whole
    path = tmp_path / "shared"
    script = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import dcp_load
        from test_save_atomic import _state
        gen = int(os.environ["RANK"]) + 1
        try:
            dcp_load.save(_state(gen), checkpoint_id={str(path)!r}, no_dist=True)
            print("SAVED", gen)
        except dcp_load.LoadError as e:
            print("REFUSED", e)
    """)
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555",
           "TORCHELASTIC_RUN_ID": "both"}
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    lines = [next((x for x in o.splitlines() if x.startswith(("SAVED", "REFUSED"))), e) for o, e in outs]
    saved = [int(line.split()[1]) for line in lines if line.startswith("SAVED")]
    assert len(saved) == 1 and sum(line.startswith("REFUSED") for line in lines) == 1, lines
    _assert_holds(path, saved[0])


def test_a_failed_commit_keeps_the_old_checkpoint_and_removes_the_new_files(saved):
    # The data file fits under RLIMIT_FSIZE, the metadata (holding a 100 KB value) does not:
    # the kernel refuses the commit itself, after every data file was written.
    before = _listing(saved)
    script = textwrap.dedent(f"""
        import resource, signal, torch, dcp_load
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        try:
            dcp_load.save({{"w": torch.ones(8), "note": "x" * 100_000}}, checkpoint_id={str(saved)!r})
        except dcp_load.LoadError as e:
            print("REFUSED", e)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "REFUSED" in out.stdout and "commit" in out.stdout and "File too large" in out.stdout, \
        out.stdout + out.stderr
    assert _listing(saved) == before  # the new data file is gone with the failed commit
    _assert_holds(saved, 1)


def test_the_lock_file_follows_the_umask_like_the_data_files(tmp_path):
    # a directory shared by a group (umask 002): every member must be able to save again
    old = os.umask(0o002)
    try:
        dcp_load.save(_state(1), checkpoint_id=tmp_path / "ckpt")
    finally:
        os.umask(old)
    modes = {n: os.stat(tmp_path / "ckpt" / n).st_mode & 0o777 for n in os.listdir(tmp_path / "ckpt")}
    assert set(modes.values()) == {0o664}, modes


def test_a_lock_file_this_user_cannot_write_still_locks(saved, monkeypatch):
    # another user's lock file (mode 644, left by a save of theirs that was killed): flock
    # needs no write access
    import dcp_reader.write._save_lock as save_lock

    (saved / LOCK).write_bytes(b"")

    real_open = os.open

    def other_users_file(path, flags, *args):
        if str(path).endswith(LOCK) and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(save_lock.os, "open", other_users_file)
    with NativeWriter(saved).lock():
        with pytest.raises(WriterLockError):
            NativeWriter(saved).lock()  # still exclusive
    dcp_load.save(_state(2), checkpoint_id=saved)
    _assert_holds(saved, 2)


def test_files_named_like_old_versions_but_not_written_by_them_are_kept(saved):
    # A user's pickle named values.pkl and a plain safetensors file named rank-00000.safetensors
    # (no native marker), put beside a checkpoint whose metadata never named them: not leftovers.
    import pickle

    from safetensors.torch import save_file

    (saved / "values.pkl").write_bytes(pickle.dumps({"mine": 1}))
    save_file({"x": torch.ones(2)}, str(saved / "rank-00000.safetensors"))
    mine = {n: (saved / n).read_bytes() for n in ("values.pkl", "rank-00000.safetensors")}
    assert verify_checkpoint(saved).ok, verify_checkpoint(saved).problems
    dcp_load.save(_state(2), checkpoint_id=saved)
    assert {n: (saved / n).read_bytes() for n in mine if (saved / n).exists()} == mine
    _assert_holds(saved, 2)


def test_an_old_versions_checkpoint_is_removed_by_an_overwrite(tmp_path):
    # what dcp-reader 0.3 wrote: names without a save id, the pickled values in values.pkl
    from dcp_reader import CheckpointMetadata, ChunkMeta, TensorMeta, chunk_key

    path = tmp_path / "ckpt"
    w = NativeWriter(path, allow_pickle=True)
    w.write_file("rank-00000.safetensors", {chunk_key("w", (0,)): torch.ones(4)})
    w.write_file("rank-00001.safetensors", {chunk_key("w", (2,)): torch.ones(2)})  # a killed save's
    values = w.write_values({"sched": Schedule()})
    w.commit(CheckpointMetadata(tensors={"w": TensorMeta("w", (4,), "float32", (
        ChunkMeta((0,), (4,), "rank-00000.safetensors", chunk_key("w", (0,))),))}, values=values, format="native"))
    assert [p.split("'")[1] for p in verify_checkpoint(path).problems] == ["rank-00001.safetensors"]
    dcp_load.save(_state(2), checkpoint_id=path)
    assert not {"rank-00000.safetensors", "rank-00001.safetensors", "values.pkl"} & set(os.listdir(path))
    _assert_holds(path, 2)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", ["torch-dcp", "hf"])
def test_a_save_into_another_formats_checkpoint_is_refused(tmp_path, kind):
    # A native checkpoint beside it would hide it from load (dcp-metadata.json is detected
    # first), and a killed save's data file made a one-file hf checkpoint undetectable.
    import torch.distributed.checkpoint as tdcp
    from safetensors.torch import save_file

    path = tmp_path / "other"
    if kind == "torch-dcp":
        tdcp.save({"w": torch.ones(8, 4)}, checkpoint_id=str(path), no_dist=True)
    else:
        path.mkdir()
        save_file({"w": torch.ones(8, 4)}, str(path / "weights.safetensors"))
    before = _listing(path)
    with pytest.raises(LoadError, match=rf"holds a {kind} checkpoint.*another directory"):
        dcp_load.save(_state(1), checkpoint_id=path)
    assert _listing(path) == before
    got = {"w": torch.zeros(8, 4)}
    dcp_load.load(got, checkpoint_id=path, no_dist=True)
    assert torch.equal(got["w"], torch.ones(8, 4))


@pytest.mark.parametrize("kind", ["file", "fifo", "dangling symlink"])
def test_a_checkpoint_id_that_is_not_a_directory_is_named(tmp_path, kind):
    path = tmp_path / "target"
    if kind == "file":
        path.write_bytes(b"mine")
    elif kind == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(tmp_path / "nowhere", path)
    with pytest.raises(LoadError, match=rf"{path}.* is a {kind}, not a directory.*checkpoint_id"):
        dcp_load.save(_state(1), checkpoint_id=path)
    assert os.path.lexists(path) and not os.path.exists(tmp_path / "nowhere")
