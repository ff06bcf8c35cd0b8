"""The package people install: ``python -m build`` makes an sdist and a wheel; the wheel installs into a fresh
virtual environment with NumPy as its only dependency, and the ``attnkit`` command (``--version``, ``bench``,
``demo``) and every public module work there, from the installed files rather than from this source tree.

Nothing is downloaded: the wheel is built without build isolation (this environment's setuptools), and the
fresh environment borrows this environment's NumPy through a ``.pth`` file that lists a folder holding only
NumPy's files. For the demo (which draws with matplotlib), a second ``.pth`` then lends it this
environment's other packages, after its own.
"""
from __future__ import annotations

import email.parser
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md")


def _run(cmd, cwd, env, timeout=300):
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=timeout, check=False)
    assert result.returncode == 0, (f"{' '.join(map(str, cmd))} exited {result.returncode}\n"
                                    f"stdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}")
    return result


def _clean_env(**extra) -> dict:
    """The environment of a user's shell: no PYTHONPATH pointing at a source tree, no virtualenv."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(MPLBACKEND="Agg", PYTHONDONTWRITEBYTECODE="1", **extra)
    return env


def _numpy_only_folder(folder: Path) -> Path:
    """A folder with links to NumPy's files (package, vendored libraries, metadata) and nothing else."""
    folder.mkdir()
    site = Path(np.__file__).resolve().parents[1]
    names = ["numpy", "numpy.libs", *(p.name for p in site.glob("numpy-*.dist-info"))]
    for name in names:
        if (site / name).exists():
            (folder / name).symlink_to(site / name)
    return folder


def _pip(venv: Path, *args, cwd: Path):
    """This environment's pip acting on ``venv`` (pip's ``--python`` option)."""
    return _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", *args], cwd=cwd,
                env=_clean_env(PIP_DISABLE_PIP_VERSION_CHECK="1"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An sdist and a wheel built from a copy of the sources (the tree itself stays untouched)."""
    pytest.importorskip("build", reason="the packaging test needs the pinned 'build' (pip install -e '.[test]')")
    work = tmp_path_factory.mktemp("package")
    src = work / "src-copy"
    src.mkdir()
    for name in _SOURCES:
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    dist = work / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, src], cwd=work, env=_clean_env())
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    return work, wheels[0], sdists[0]


@pytest.fixture(scope="module")
def fresh_env(built):
    """A new virtual environment holding the wheel, with this environment's NumPy and nothing else."""
    work, wheel, _ = built
    venv = work / "venv"
    # No pip inside (seeding one takes long): this environment's pip installs into it with --python.
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=work, env=_clean_env())
    python = venv / "bin" / "python"
    site = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=work,
                     env=_clean_env()).stdout.strip())
    (site / "numpy-only.pth").write_text(f"{_numpy_only_folder(work / 'numpy-only')}\n")
    _pip(venv, "install", "--quiet", "--no-index", "--no-deps", wheel, cwd=work)
    return work, venv, site


def test_build_makes_an_sdist_and_a_wheel_of_this_version(built):
    import attnkit

    _, wheel, sdist = built
    assert wheel.name == f"attnkit-{attnkit.__version__}-py3-none-any.whl"
    assert sdist.name == f"attnkit-{attnkit.__version__}.tar.gz"
    assert attnkit.__version__ == "0.5.0.dev0"


def test_the_wheel_depends_on_numpy_only_and_carries_its_data_and_license(built):
    _, wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(z.read(meta_name).decode("utf-8"))
    required = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert [r.replace(" ", "") for r in required] == ["numpy>=2.0"]
    assert meta["Version"] == "0.5.0.dev0"
    assert "attnkit/templates/attention_explorer.html" in names  # the explorer page's template
    assert "attnkit/py.typed" in names
    assert any(n.endswith((".dist-info/licenses/LICENSE", ".dist-info/LICENSE")) for n in names)
    assert not any(n.startswith(("tests/", "benchmarks/", "docs/")) for n in names)


def test_installed_environment_holds_attnkit_and_numpy_only(fresh_env):
    work, venv, _ = fresh_env
    listed = json.loads(_pip(venv, "list", "--format=json", cwd=work).stdout)
    assert {p["name"].lower(): p["version"] for p in listed} == {"attnkit": "0.5.0.dev0", "numpy": np.__version__}
    assert "No broken requirements" in _pip(venv, "check", cwd=work).stdout


def test_installed_command_prints_its_version(fresh_env):
    work, venv, _ = fresh_env
    out = _run([venv / "bin" / "attnkit", "--version"], cwd=work, env=_clean_env()).stdout
    assert out.strip() == "attnkit 0.5.0.dev0"


def test_every_public_module_imports_from_the_installed_wheel(fresh_env):
    work, venv, site = fresh_env
    script = (
        "import importlib, pkgutil, attnkit, numpy\n"
        "names = sorted(m.name for m in pkgutil.walk_packages(attnkit.__path__, 'attnkit.')\n"
        "               if not any(part.startswith('_') for part in m.name.split('.')))\n"
        "for name in names:\n"
        "    if name.split('.')[:2] == ['attnkit', 'torch']:\n"
        "        continue\n"
        "    importlib.import_module(name)\n"
        "try:\n"
        "    import attnkit.torch\n"
        "except ImportError as err:\n"
        "    hint = str(err)\n"
        "print(attnkit.__file__)\n"
        "print(' '.join(n for n in names if not n.startswith('attnkit.torch')))\n"
        "print(hint)\n"
    )
    out = _run([venv / "bin" / "python", "-c", script], cwd=work, env=_clean_env()).stdout.splitlines()
    assert Path(out[0]).is_relative_to(site)  # the installed copy, not the source tree
    imported = set(out[1].split())
    assert {"attnkit.attention_core", "attnkit.multi_head", "attnkit.kernels.tiled", "attnkit.layers",
            "attnkit.models", "attnkit.optim", "attnkit.viz", "attnkit.pretrained"} <= imported
    assert len(imported) >= 40
    # The PyTorch twins are the torch extra's: without torch they say how to get it, in one line.
    assert out[2] == "attnkit.torch needs PyTorch: pip install 'attnkit[torch]'"


def test_installed_bench_runs_from_the_wheel_with_numpy_only(fresh_env):
    work, venv, _ = fresh_env
    out = work / "bench-out"
    result = _run([venv / "bin" / "attnkit", "bench", "--sizes", "256", "--repeats", "1", "--threads", "1",
                   "--heads", "2", "--dim", "16", "--out", out], cwd=work, env=_clean_env())
    assert "256" in result.stdout
    assert "torch" in (result.stdout + result.stderr).lower()  # the line saying PyTorch is not installed
    report = json.loads((out / "attention-benchmark.json").read_text(encoding="utf-8"))
    assert report


def test_installed_demo_trains_and_writes_its_files(fresh_env):
    work, venv, site = fresh_env
    # The demo draws with matplotlib (the viz extra): lend it this environment's packages, after the venv's own.
    (site / "zz-lent-packages.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")
    try:
        out = work / "demo-out"
        result = _run([venv / "bin" / "attnkit", "demo", "--steps", "20", "--no-progress", "--out", out],
                      cwd=work, env=_clean_env())
    finally:
        (site / "zz-lent-packages.pth").unlink()
    assert "held-out accuracy" in result.stdout
    for name in ("attention.png", "attention.html", "loss.png", "model.npz", "model.json"):
        assert (out / name).stat().st_size > 0, name
