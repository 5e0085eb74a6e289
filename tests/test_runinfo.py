"""run_info.json records what computes a run's numbers: the numeric libraries, the pflkit plugins, the CPU and the
kernels torch picked for it (numbers may differ in the last bits across CPUs; README "Reproducibility")."""
import json
from importlib.metadata import version

import torch

from pflkit.core.storage import runinfo
from pflkit.core.testing import quick_run


def test_run_info_records_numeric_libraries_plugins_and_cpu_kernels(tmp_path):
    quick_run("fedavg", tmp_path, {"rounds": 1})
    (entry,) = json.loads((tmp_path / "run" / "run_info.json").read_text())["entries"]
    libs = entry["libraries"]
    assert set(libs) == {"torch", "numpy", "scipy", "scikit-learn", "zuko", "torchvision"}
    assert libs["numpy"] == version("numpy") and libs["torch"] == version("torch")
    assert libs["scipy"] == version("scipy") and libs["scikit-learn"] == version("scikit-learn")
    assert entry["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert entry["cpu_model"]
    # every distribution providing a component of this run is among the recorded plugins, at its version
    for comp in entry["components"].values():
        assert entry["plugins"][comp["distribution"]] == comp["version"]
    assert entry["plugins"]["pflkit-fedavg"] == version("pflkit-fedavg")


def test_cpu_capability_is_none_on_a_torch_that_cannot_tell(monkeypatch):
    def missing():
        raise AttributeError("get_cpu_capability")

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", missing)
    assert runinfo.cpu_capability() is None
    assert runinfo.device_info(torch.device("cpu"))["cpu_capability"] is None
