"""The wheel holds everything the main job needs: build it, install it into a fresh
virtualenv, and run the main job away from the checkout through the console command it
installs (``mutable-buffer-passes run``, the same as ``python -m passes run``).

The virtualenv reuses this interpreter's torch / torchao (a ``.pth`` line pointing at its
site-packages) instead of downloading them; the package itself comes only from the wheel,
which the test checks before running the job.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("setup.cfg", "pyproject.toml", "README.md", "pass_manager", "passes")


def run(*command: str | Path, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def build_wheel(tmp_path: Path) -> Path:
    # A copy of the sources, so the build's build/ and *.egg-info stay out of the checkout.
    source = tmp_path / "source"
    source.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name)
    for cache in source.rglob("__pycache__"):
        shutil.rmtree(cache)
    dist = tmp_path / "dist"
    # This interpreter's setuptools builds it: no network, no isolated build env.
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
        "--no-index", "--quiet", "-w", dist, source, cwd=tmp_path)
    (wheel,) = dist.glob("*.whl")
    return wheel


def fresh_venv_with_project_torch(path: Path) -> Path:
    venv.EnvBuilder(with_pip=False).create(path)
    python = path / "bin" / "python"
    site = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
               cwd=path).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    # Plain path lines: torch and friends become importable, but not the .pth files of this
    # environment (its editable install of the package would hide the wheel's copy).
    (Path(site) / "project_site_packages.pth").write_text("\n".join(sorted(ours)) + "\n")
    return python


def test_wheel_runs_the_main_job_outside_the_checkout(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        modules = {name: archive.read(name).decode() for name in archive.namelist()
                   if name.endswith(".py")}
    assert {name.split("/")[0] for name in modules} == {"passes", "pass_manager"}
    # Demo cases built on ExecuTorch's test backends are test models, not the product.
    assert not [name for name, text in modules.items() if "executorch.exir.backend.test" in text]
    python = fresh_venv_with_project_torch(tmp_path / "venv")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "--quiet", wheel, cwd=tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # One interpreter start (each imports torch, ~4 s) answers where the packages come from,
    # their version and the install hint.
    *where, version, hint = run(
        python, "-c", "import passes, pass_manager; from passes.executorch import INSTALL_HINT; "
        "print(passes.__file__, pass_manager.__file__, passes.__version__, INSTALL_HINT, "
        "sep='\\n')", cwd=elsewhere).stdout.strip().split("\n")
    assert len(where) == 2 and all(Path(f).is_relative_to(tmp_path / "venv") for f in where), where

    # The version setup.cfg reads from passes.__version__ is the one the wheel carries.
    assert wheel.name.startswith(f"mutable_buffer_passes-{version}-")
    command = python.parent / "mutable-buffer-passes"
    assert run(command, "--version", cwd=elsewhere).stdout.startswith(
        f"mutable-buffer-passes {version} (torch ")
    assert run(command, "run", "--help", cwd=elsewhere).stdout.startswith(
        "usage: mutable-buffer-passes run")
    assert run(python, "-m", "passes", "--help", cwd=elsewhere).stdout.startswith(
        "usage: python -m passes")

    # No checkout to name: the hint gave "-c constraints.txt -e '.[executorch]'".
    assert hint == ("pip install --no-deps executorch==1.5.1 && pip install "
                    "'mutable-buffer-passes[executorch]'")

    # Every stage of the main job, each from the wheel's modules, on the main job's own model
    # from the wheel's examples at one layer (the stages do not depend on the depth; two
    # layers doubled the lowering and quantization time).
    (elsewhere / "one_layer.py").write_text(
        "from passes.examples import stateful_decoder_job\n\n\n"
        "def job():\n    return stateful_decoder_job(n_layers=1)\n")
    done = run(command, "run", "one_layer.py:job", "--steps", "2", cwd=elsewhere, timeout=900)
    assert done.stdout.startswith("model: one_layer.py:job (")
    assert "runtime executorch" in done.stdout.splitlines()[0]
    assert "executorch quantized: " in done.stdout  # lowered and run on the runtime
    assert "== checks" in done.stdout
    assert "FAIL" not in done.stdout.split("== checks")[1]
