"""Issue 40, item 2: the first torch optimizer a process builds imports ``torch._dynamo`` (about 1 s and 110 MiB).
A sequential run pays that import while it sets up, before round 1's timer; a batched run, which builds no
optimizer, never pays it. Each case runs in a fresh interpreter: this test process has long imported it."""
from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys, tempfile
from pathlib import Path
from pflkit.core.testing import tiny_simulation
before = 'torch._dynamo' in sys.modules
sim = tiny_simulation('fedavg', Path(tempfile.mkdtemp()) / 'run', sets=('rounds=1', 'clients.batched={mode}'))
print(before, 'torch._dynamo' in sys.modules, sim.batched_plan.batched)
"""


@pytest.mark.parametrize("mode, imported", [("off", True), ("on", False)])
def test_sequential_set_up_pays_the_optimizer_import_before_round_one(mode, imported):
    out = subprocess.run([sys.executable, "-c", PROBE.format(mode=mode)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, batched = out.stdout.split()[-3:]
    assert before == "False"  # importing pflkit.core does not pay it
    assert after == str(imported) and batched == str(mode == "on")
