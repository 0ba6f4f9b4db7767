"""Runs a bench script under a virtual environment that has onnxruntime-genai.

onnxruntime-genai is a comparison target, never a dependency of ortex: on first use it is installed
from bench/requirements.txt into .cache/genai-venv, and the calling script re-executes itself there.
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
    try:
        import onnxruntime_genai  # noqa: F401
        import numpy  # noqa: F401
        return
    except ImportError:
        pass
    py = VENV / "bin" / "python"
    marker = "ORTEX_GENAI_VENV_REEXEC"
    if os.environ.get(marker):
        fail("onnxruntime_genai is not importable even in " + str(VENV))
    if not py.exists():
        log(f"creating {VENV} (pip install -r bench/requirements.txt)")
        try:
            subprocess.check_call([sys.executable, "-m", "venv", str(VENV)])
            subprocess.check_call([str(py), "-m", "pip", "install", "-q", "-r", str(ROOT / "bench" / "requirements.txt")])
        except (OSError, subprocess.CalledProcessError) as e:
            fail(f"cannot install onnxruntime-genai into {VENV}: {e}")
    env = dict(os.environ, **{marker: "1"})
    os.execve(str(py), [str(py), str(Path(script).resolve()), *sys.argv[1:]], env)
