"""The public reference library (``comlrl==1.4.3`` from PyPI) in its own virtual environment.

``reference_python(root)`` creates ``root/.reference-venv`` once and returns its python; the benchmark
runs ``benchmarks/reference_case.py`` with it. Nothing here imports ``comlrl_core`` or ``comlrl``.

Install order matters: ``torch==2.13.0`` first (a CPU build, from the local package index, in seconds;
an unpinned torch pulled in by ``comlrl`` would be a multi-GB CUDA build), then ``comlrl==1.4.3`` with
``transformers==5.24.0``. That is the latest transformers, the version our tiny and bench models are
saved with, and the one ``comlrl`` 1.4.3 resolves to on its own (it asks for ``transformers>=4.30``):
its MAGRPO, IAC, MAAC and MARLHF trainers construct, train and evaluate with it, so no older version is
needed (and an older one could not read the ``rope_parameters`` our 5.x-saved configs use).

The build is atomic-ish: a marker file (``reference-ok.json``, the requirements and installed versions)
is written last, only after the packages import and report the expected versions; a venv without the
marker (an interrupted or failed install) is removed and rebuilt, never reused.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

VENV_NAME = ".reference-venv"
MARKER = "reference-ok.json"
# Installed in this order, one pip call each.
REQUIREMENTS = (("torch==2.13.0",), ("comlrl==1.4.3", "transformers==5.24.0"))
EXPECTED = {"torch": "2.13.0", "comlrl": "1.4.3", "transformers": "5.24.0"}
_CHECK = ("import json, importlib.metadata as m; "
          "import torch, transformers, comlrl.trainers; "
          "print(json.dumps({n: m.version(n) for n in ('torch', 'transformers', 'comlrl')}))")


def _python(venv: Path) -> Path:
    return venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def _versions(venv: Path) -> dict | None:
    """The installed versions if the venv imports its packages, else None."""
    python = _python(venv)
    if not python.exists():
        return None
    try:
        done = subprocess.run([str(python), "-c", _CHECK], capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _matches(versions: dict | None) -> bool:
    # torch reports a local build suffix ("2.13.0+cpu").
    return bool(versions) and all(versions.get(n, "").split("+")[0] == v for n, v in EXPECTED.items())


def _usable(venv: Path) -> bool:
    marker = venv / MARKER
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text())
    except ValueError:
        return False
    return recorded.get("requirements") == [list(r) for r in REQUIREMENTS] and _matches(_versions(venv))


def reference_python(root: Path) -> Path:
    """The python of ``root/.reference-venv`` with ``comlrl==1.4.3`` installed; built on first use."""
    root = Path(root).resolve()
    venv = root / VENV_NAME
    if _usable(venv):
        return _python(venv)
    if venv.exists():
        print(f"reference venv: {venv} is incomplete or stale, rebuilding", flush=True)
        shutil.rmtree(venv)
    try:
        print(f"reference venv: creating {venv} with {sys.executable} -m venv", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = _python(venv)
        for group in REQUIREMENTS:
            print(f"reference venv: pip install {' '.join(group)}", flush=True)
            subprocess.run([str(python), "-m", "pip", "install", "--quiet", *group], check=True)
        versions = _versions(venv)
        if not _matches(versions):
            raise RuntimeError(f"reference venv check failed: installed {versions}, expected {EXPECTED}")
        print(f"reference venv: installed {versions}", flush=True)
        (venv / MARKER).write_text(json.dumps({"requirements": [list(r) for r in REQUIREMENTS],
                                               "versions": versions}) + "\n")  # last: marks it complete
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    return _python(venv)


if __name__ == "__main__":
    print(reference_python(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / ".bench"))
