"""Files are written atomically: a failed or interrupted write leaves the previous file intact and loadable.

Three ways a write can die are tried on every writer (Module.save, Optimizer.save, the demo's model pair):
a file-size limit (``RLIMIT_FSIZE`` in a subprocess, SIGXFSZ ignored, so the write gets EFBIG as on a full
disk), an exception in the middle of the write (no temporary file may remain), and SIGKILL of a child
process in the middle of a large save.
"""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from attnkit import io as attnkit_io
from attnkit.core import Module, ModuleList
from attnkit.demos import encoder as demo
from attnkit.io import atomic_write, atomic_write_files, save_arrays
from attnkit.layers import Projection
from attnkit.optim import Adam

SRC = str(Path(__file__).resolve().parents[2] / "src")
TIMEOUT = 120


def temporaries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT)


def stepped_adam(seed: int) -> Adam:
    proj = Projection(100, 200, rng=seed)  # 160 kB of float64 weights, 480 kB of optimizer state
    opt = Adam(proj, lr=0.01)
    proj.grads["W"][:] = np.random.default_rng(seed).normal(size=proj.W.shape)
    opt.step()
    return opt


def small_demo_config(seed: int) -> demo.DemoConfig:
    return demo.DemoConfig(steps=1, batch_size=4, eval_size=4, eval_points=1, seed=seed)


# -- a file-size limit (EFBIG, like a full disk) ------------------------------------------------------------
SIZE_LIMITED = """
    import resource, signal, sys
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # otherwise the kernel kills us instead of failing the write
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
    kind, path = sys.argv[1], sys.argv[2]
    try:
        if kind == "module":
            from attnkit.layers import Projection
            Projection(100, 200, rng=1).save(path)
        elif kind == "optimizer":
            from attnkit.layers import Projection
            from attnkit.optim import Adam
            Adam(Projection(100, 200, rng=1), lr=0.5).save(path)
        else:
            from attnkit.demos import encoder as demo
            config = demo.DemoConfig(steps=1, batch_size=4, eval_size=4, eval_points=1, seed=1)
            demo.save_model(demo.train(config), path)
    except OSError as exc:
        print("write failed:", exc.errno)
    else:
        print("write succeeded")
"""


@pytest.mark.parametrize("kind", ["module", "optimizer", "demo"])
def test_write_beyond_the_file_size_limit_keeps_the_previous_checkpoint(tmp_path, kind):
    import errno

    if kind == "module":
        target = tmp_path / "model.npz"
        Projection(100, 200, rng=0).save(target)
    elif kind == "optimizer":
        target = tmp_path / "adam.npz"
        stepped_adam(0).save(target)
    else:
        target = tmp_path
        demo.save_model(demo.train(small_demo_config(0)), target)
    files = sorted(p for p in tmp_path.iterdir())
    before = {p.name: p.read_bytes() for p in files}
    assert max(len(b) for b in before.values()) > 64 * 1024  # the write must cross the limit

    result = run_python(SIZE_LIMITED, kind, str(target))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"write failed: {errno.EFBIG}"
    assert temporaries(tmp_path) == []
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # byte for byte
    if kind == "module":
        proj = Projection(100, 200, rng=5)
        proj.load(target)
        assert np.array_equal(proj.W, Projection(100, 200, rng=0).W)
    elif kind == "optimizer":
        opt = Adam(Projection(100, 200, rng=0))
        opt.load(target)
        assert opt.step_count == 1 and np.array_equal(opt.state["W"]["exp_avg"], stepped_adam(0).state["W"]["exp_avg"])
    else:
        model, meta = demo.load_model(target)
        assert meta["training"]["seed"] == 0
        trained = demo.train(small_demo_config(0)).model
        assert np.array_equal(model.state_dict()["head.W"], trained.state_dict()["head.W"])


# -- an exception in the middle of a write ------------------------------------------------------------------
def test_an_exception_mid_write_leaves_the_previous_file_and_no_temporary(tmp_path):
    path = tmp_path / "model.npz"
    Projection(3, 4, rng=0).save(path)
    before = path.read_bytes()
    proj = Projection(3, 4, rng=1)
    # the first entry is written, then the second cannot be: object arrays are never pickled
    proj.state_dict = lambda: {"W": np.ones((3, 4)), "b": np.array([None], dtype=object)}
    with pytest.raises(ValueError, match="'b' has dtype object"):
        proj.save(path)
    assert path.read_bytes() == before and temporaries(tmp_path) == []


@pytest.mark.parametrize("exc", [RuntimeError("disk on fire"), KeyboardInterrupt()])
def test_atomic_write_removes_its_temporary_file_on_any_exception(tmp_path, exc):
    path = tmp_path / "file.bin"

    def dies(f):
        f.write(b"x" * 100_000)
        raise exc

    with pytest.raises(type(exc)):
        atomic_write(path, dies)
    assert list(tmp_path.iterdir()) == []  # no file, no temporary
    path.write_bytes(b"previous")
    with pytest.raises(type(exc)):
        atomic_write(path, dies)
    assert path.read_bytes() == b"previous" and temporaries(tmp_path) == []


def test_a_group_of_files_is_replaced_only_when_every_file_was_written(tmp_path):
    a, b = tmp_path / "model.npz", tmp_path / "model.json"
    a.write_bytes(b"previous weights")
    b.write_bytes(b"previous config")

    def fails(f):
        f.write(b"half a config")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write_files({a: lambda f: f.write(b"written weights"), b: fails})
    assert (a.read_bytes(), b.read_bytes()) == (b"previous weights", b"previous config")
    assert temporaries(tmp_path) == []
    atomic_write_files({a: lambda f: f.write(b"written weights"), b: lambda f: f.write(b"written config")})
    assert (a.read_bytes(), b.read_bytes()) == (b"written weights", b"written config")


def test_demo_pair_survives_a_failure_while_writing_the_config(tmp_path, monkeypatch):
    # model.npz's temporary file is complete when writing model.json's fails half-way: neither is replaced
    demo.save_model(demo.train(small_demo_config(0)), tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    result = demo.train(small_demo_config(1))
    write_temporary, written = attnkit_io._write_temporary, []

    def second_file_fails(dest, write):
        written.append(dest.name)
        if len(written) == 2:
            def half_then_no_space(f):
                f.write(b'{"format": ')
                raise OSError(28, "No space left on device")
            return write_temporary(dest, half_then_no_space)
        return write_temporary(dest, write)

    monkeypatch.setattr(attnkit_io, "_write_temporary", second_file_fails)
    with pytest.raises(OSError, match="No space left"):
        demo.save_model(result, tmp_path)
    assert written == ["model.npz", "model.json"]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    monkeypatch.undo()
    _, meta = demo.load_model(tmp_path)
    assert meta["training"]["seed"] == 0


# -- SIGKILL in the middle of a large save ------------------------------------------------------------------
KILLED = """
    import sys
    from numpy.lib import format as npy_format
    from attnkit.core import ModuleList
    from attnkit.layers import Projection
    write_array = npy_format.write_array
    written = []

    def pausing_write_array(fp, *args, **kwargs):  # the parent kills us while the temp file holds part of it
        write_array(fp, *args, **kwargs)
        written.append(None)
        if len(written) == 3:
            fp.flush()
            print("partial", flush=True)
            sys.stdin.readline()  # wait for the SIGKILL (the parent never writes)

    npy_format.write_array = pausing_write_array
    model = ModuleList([Projection(512, 1024, rng=100 + i) for i in range(8)])  # 32 MB
    print("saving", flush=True)
    model.save(sys.argv[1])
    print("saved", flush=True)
"""


def big_model(seed: int) -> ModuleList:
    return ModuleList([Projection(512, 1024, rng=seed + i) for i in range(8)])


@pytest.mark.concurrency
def test_sigkill_during_a_large_save_leaves_the_previous_file_loadable(tmp_path):
    path = tmp_path / "model.npz"
    big_model(0).save(path)
    before = path.read_bytes()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED), str(path)], env=env,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # A child stuck before its handshake would block readline forever; the watchdog turns that into EOF.
    watchdog = threading.Timer(TIMEOUT, child.kill)
    watchdog.start()
    try:  # the child says when it is in the middle of the save, and waits there: no race with its speed
        lines = [child.stdout.readline(), child.stdout.readline()]
        assert lines == ["saving\n", "partial\n"], (lines, child.poll())
        partial = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp") and p.stat().st_size > 4 << 20]
        assert child.poll() is None, "the child ended before it could be killed"
        assert partial, f"no partial temporary file: {sorted(p.name for p in tmp_path.iterdir())}"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=TIMEOUT)
    finally:
        watchdog.cancel()
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdin.close()
        child.stdout.close()
        child.stderr.close()
    assert child.returncode == -signal.SIGKILL
    assert path.read_bytes() == before
    loaded = big_model(50)
    loaded.load(path)
    pairs = zip(loaded.named_parameters(), big_model(0).named_parameters(), strict=True)
    assert all(np.array_equal(a, b) for (_, a), (_, b) in pairs)
    # what a kill can leave: at most the hidden, partial temporary file beside the checkpoint
    assert all(name.startswith(".model.npz.") for name in temporaries(tmp_path))


# -- what the written file is -------------------------------------------------------------------------------
def test_a_replaced_file_keeps_its_permissions_and_a_new_one_gets_the_umask_default(tmp_path):
    path = tmp_path / "model.npz"
    old_umask = os.umask(0o027)
    try:
        Projection(2, 2, rng=0).save(path)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    path.chmod(0o604)
    Projection(2, 2, rng=1).save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o604


def test_saving_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    target, link = tmp_path / "real.npz", tmp_path / "link.npz"
    Projection(2, 2, rng=0).save(target)
    link.symlink_to(target)
    Projection(2, 2, rng=1).save(link)
    assert link.is_symlink()
    proj = Projection(2, 2, rng=0)
    proj.load(target)
    assert np.array_equal(proj.W, Projection(2, 2, rng=1).W)


@pytest.mark.parametrize("where, error, message", [
    ("folder", IsADirectoryError, "is a folder, expected a file path"),
    ("missing", FileNotFoundError, "does not exist"),
    ("not_a_path", TypeError, "path must be a str or os.PathLike"),
])
def test_bad_destinations_are_refused_before_writing(tmp_path, where, error, message):
    path = {"folder": tmp_path, "missing": tmp_path / "nowhere" / "m.npz", "not_a_path": 3}[where]
    with pytest.raises(error, match=message):
        save_arrays(path, {"W": np.zeros(2)})
    assert temporaries(tmp_path) == []


def test_module_save_is_an_npz_that_numpy_reads(tmp_path):
    path = tmp_path / "m.npz"
    model = Module()
    model.register_parameter("W", np.arange(6.0).reshape(2, 3))
    model.save(path)
    with np.load(path, allow_pickle=False) as archive:
        assert archive.files == ["W"] and np.array_equal(archive["W"], model.W)


# -- what a path may name ------------------------------------------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_and_left_in_place(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"path '.*pipe' is a FIFO, not a regular file"):
        atomic_write(fifo, lambda f: f.write(b"x"))
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and temporaries(tmp_path) == []


def _null_device(folder):
    """A character device like /dev/null made in ``folder`` (never the real one: a regression would replace it)."""
    node = folder / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (AttributeError, PermissionError, OSError) as exc:
        pytest.skip(f"cannot make a device node here ({exc}); root in a container with CAP_MKNOD can")
    return node


def test_a_device_is_refused_and_left_in_place(tmp_path):
    device = _null_device(tmp_path)
    with pytest.raises(ValueError, match=r"path '.*null' is a character device, not a regular file"):
        atomic_write(device, lambda f: f.write(b"x"))
    link = tmp_path / "link"
    link.symlink_to(device)  # through a link too
    with pytest.raises(ValueError, match="is a character device"):
        atomic_write(link, lambda f: f.write(b"x"))
    assert stat.S_ISCHR(os.lstat(device).st_mode) and temporaries(tmp_path) == []


def test_a_symlink_loop_is_a_clear_error(tmp_path):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match=r"path '.*a' is a symbolic link that cannot be resolved"):
        atomic_write(tmp_path / "a", lambda f: f.write(b"x"))


def test_a_name_of_250_bytes_is_written(tmp_path):
    path = tmp_path / ("é" * 100 + "x" * 50)  # 250 bytes in UTF-8: its temporary's name must stay within 255
    assert len(os.fsencode(path.name)) == 250
    atomic_write(path, lambda f: f.write(b"long"))
    assert path.read_bytes() == b"long" and temporaries(tmp_path) == []


def test_temporaries_of_killed_writers_are_removed_by_the_next_write(tmp_path):
    path = tmp_path / "model.npz"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f".model.npz.{int(gone.stdout)}.abcd1234.tmp"  # its writer has exited
    alive = tmp_path / f".model.npz.{os.getppid()}.efgh5678.tmp"  # a live process may still be writing this one
    other = tmp_path / f".other.npz.{int(gone.stdout)}.ijkl9012.tmp"  # another file's: not ours to remove
    for p in (orphan, alive, other):
        p.write_bytes(b"partial")
    atomic_write(path, lambda f: f.write(b"new"))
    assert path.read_bytes() == b"new"
    assert temporaries(tmp_path) == sorted([alive.name, other.name])
