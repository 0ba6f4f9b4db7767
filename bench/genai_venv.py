"""Runs a bench script under a virtual environment that has what it compares ortex with.

onnxruntime-genai (and, for bench/model_coverage.py, torch and transformers) are comparison
targets, never dependencies of ortex: on first use they are installed from a requirements file
into a virtual environment, and the calling script re-executes itself there. `ensure_genai` uses
.cache/genai-venv with bench/requirements.txt; `ensure_venv` any folder and file.
"""

import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, NoReturn

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".cache" / "genai-venv"


def ensure_genai(script: str, fail: Callable[[str], NoReturn], log: Callable[[str], None]) -> None:
    """Returns when onnxruntime_genai and numpy import here; else re-executes `script` in the venv."""
    ensure_venv(script, VENV, ROOT / "bench" / "requirements.txt", ["onnxruntime_genai", "numpy"], fail, log)


def ensure_venv(
    script: str,
    venv: Path,
    requirements: Path,
    modules: list[str],
    fail: Callable[[str], NoReturn],
    log: Callable[[str], None],
) -> None:
    """Returns when every module in `modules` imports here; else creates `venv` from
    `requirements` (once) and re-executes `script` with its arguments there."""
    import importlib

    try:
        for module in modules:
            importlib.import_module(module)
        return
    except ImportError:
        pass
    py = venv / "bin" / "python"
    marker = "ORTEX_BENCH_VENV_REEXEC"
    if os.environ.get(marker):
        fail(f"{', '.join(modules)} not importable even in {venv}")
    if not py.exists():
        log(f"creating {venv} (pip install -r {requirements.relative_to(ROOT)})")
        try:
            subprocess.check_call([sys.executable, "-m", "venv", str(venv)])
            subprocess.check_call([str(py), "-m", "pip", "install", "-q", "-r", str(requirements)])
        except (OSError, subprocess.CalledProcessError) as e:
            fail(f"cannot install {requirements.name} into {venv}: {e}")
    env = dict(os.environ, **{marker: "1"})
    os.execve(str(py), [str(py), str(Path(script).resolve()), *sys.argv[1:]], env)
