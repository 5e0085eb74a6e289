"""Build hook: a wheel built from a git checkout records that checkout's commit (and whether tracked files differed
from it) in ``pflkit/core/build_info.json``, so a run of a README-style install (``pip install .``, no checkout at
run time) still says which commit computed it (``run_info.json``'s ``git``, core/storage/runinfo.py). Everything
else is declared in setup.cfg."""
import json
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def checkout_state():
    """{commit, dirty} of the checkout this is built from, or None (no git, not a checkout)."""
    if not (ROOT / ".git").exists():
        return None
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip())}


class BuildWithInfo(build_py):
    def run(self):
        super().run()
        state = checkout_state()
        if state is not None and not self.editable_mode:  # an editable install reads the checkout itself
            target = Path(self.build_lib) / "pflkit" / "core" / "build_info.json"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(json.dumps(state))


setup(cmdclass={"build_py": BuildWithInfo})
