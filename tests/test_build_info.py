"""A README-style install (``pip install .``: a wheel, no checkout at run time) still records which commit computed a
run (issue 36): the wheel built from a git checkout carries that commit and whether tracked files differed
(``pflkit/core/build_info.json``, setup.py), and ``run_info.json``'s ``git`` reads it."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pflkit.core.storage import runinfo

REPO = Path(__file__).resolve().parents[1]


def test_an_installed_pflkit_reports_the_commit_it_was_built_from(tmp_path, monkeypatch):
    info = tmp_path / "build_info.json"
    info.write_text(json.dumps({"commit": "abc123", "dirty": False}))
    monkeypatch.setattr(runinfo, "BUILD_INFO", info)
    assert runinfo.built_from() == {"commit": "abc123", "dirty": False, "path": "installed (built from this commit)"}
    assert runinfo.git_commit(tmp_path / "no-checkout") is None  # an explicit source that is no checkout: unknown
    info.write_text("{not json")
    assert runinfo.built_from() is None  # a damaged file is no provenance


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs git and this checkout")
def test_a_wheel_built_from_a_checkout_carries_its_commit(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True, timeout=120)
    head = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    wheels = tmp_path / "wheels"
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                            str(wheels), str(clone)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = wheels.glob("pflkit-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        state = json.loads(zf.read("pflkit/core/build_info.json"))
    assert state == {"commit": head, "dirty": False}
