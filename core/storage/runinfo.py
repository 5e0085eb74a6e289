"""``run_info.json``: how and where a run was computed (command line, versions, git commit, threads, device, host).

It records every library that affects the numbers (torch, numpy, scipy, scikit-learn, zuko, torchvision, the
installed pflkit plugins) and the CPU's kernels (``torch.backends.cpu.get_cpu_capability()``, the CPU model):
numbers are identical on one machine and library set, and may differ in the last bits on another CPU.

One entry is written when a run starts and one more each time it is resumed, so a run directory says which
software and machine produced each stretch of its rounds.
"""
from __future__ import annotations

import json
import os
import platform
import shlex
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

RUN_INFO_NAME = "run_info.json"
# config section -> registry kind attribute in core.api.registry
# distributions whose code computes a run's numbers (besides pflkit and its plugins)
NUMERIC_LIBRARIES = ("torch", "numpy", "scipy", "scikit-learn", "zuko", "torchvision")
_COMPONENTS = {"algorithm": "ALGORITHMS", "dataset": "DATASETS", "partition": "PARTITIONERS", "model": "MODELS",
               "trainer": "TRAINERS", "aggregator": "AGGREGATORS"}


def _version(dist: str) -> Optional[str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def component_versions(cfg: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """For each component the run uses: its name, the distribution providing it and that distribution's version."""
    from ..api import registry as reg

    out: Dict[str, Dict[str, Any]] = {}
    for section, attr in _COMPONENTS.items():
        name = cfg[section] if section == "algorithm" else cfg[section]["name"]
        entry = next((e for e in getattr(reg, attr).entries() if e.name == name), None)
        out[section] = {"name": name, "distribution": getattr(entry, "dist", None),
                        "version": getattr(entry, "version", None)}
    return out


def library_versions() -> Dict[str, Optional[str]]:
    """Version of each library in NUMERIC_LIBRARIES (None when not installed)."""
    return {dist: _version(dist) for dist in NUMERIC_LIBRARIES}


def plugin_versions() -> Dict[str, str]:
    """Every installed distribution that registers a pflkit component (datasets, models, algorithms, ...), with its
    version: the run's own components and any other plugin that might have been imported alongside them."""
    from ..api import registry as reg

    found: Dict[str, str] = {}
    for registry in reg.ALL_REGISTRIES.values():
        for entry in registry.entries():
            if entry.dist != "<in-process>":
                found[entry.dist] = entry.version
    return dict(sorted(found.items()))


def cpu_model() -> Optional[str]:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else what the platform module reports)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def cpu_capability() -> Optional[str]:
    """The vector instruction set torch's CPU kernels use here (e.g. 'AVX2', 'AVX512'): kernels for different
    capabilities may round differently. None on a torch too old to say."""
    import torch

    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return None


BUILD_INFO = Path(__file__).resolve().parents[1] / "build_info.json"  # written by setup.py into a built wheel


def git_commit(source: Optional[Path] = None) -> Optional[Dict[str, Any]]:
    """Commit (and whether tracked files differ from it) of the checkout pflkit runs from; for an install built from
    a checkout (``pip install .``), the commit it was built from (``build_info.json``, setup.py); None when neither
    is known or git is unavailable. Only a checkout whose root holds the package counts (not a parent repo)."""
    # core/storage/runinfo.py: the checkout's root is two folders above this one
    root = Path(source) if source is not None else Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return built_from() if source is None else None
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status.strip()), "path": str(root)}


def built_from() -> Optional[Dict[str, Any]]:
    """The checkout an installed pflkit was built from (commit, dirty), as setup.py recorded it; None if unknown."""
    try:
        doc = json.loads(BUILD_INFO.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("commit"), str):
        return None
    return {"commit": doc["commit"], "dirty": bool(doc.get("dirty")), "path": "installed (built from this commit)"}


def device_info(device: Any) -> Dict[str, Any]:
    import torch

    info: Dict[str, Any] = {"device": str(device)}
    if getattr(device, "type", None) == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
    else:
        info["device_name"] = platform.processor() or platform.machine()
    info["cpu_count"] = os.cpu_count()
    info["cpu_model"] = cpu_model()
    info["cpu_capability"] = cpu_capability()
    return info


# a worker pinned to one GPU by a comparison (core/results/placement.py) says where in this variable (JSON)
ENV_PLACEMENT = "PFLKIT_PLACEMENT"
# a run started by a cluster job (core/results/launchers.py): the job's id and where its stdout and stderr are (JSON)
ENV_JOB = "PFLKIT_JOB"


def _env_record(variable: str) -> Optional[Dict[str, Any]]:
    """The JSON object in environment variable ``variable`` (a GPU placement, a cluster job), for run_info.json;
    None when unset or not an object."""
    text = os.environ.get(variable)
    if not text:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def collect(cfg: Mapping[str, Any], device: Any, threads: int, event: str, from_round: int) -> Dict[str, Any]:
    """One ``run_info.json`` entry: ``event`` is 'start' or 'resume'."""
    import torch

    from ..common.threads import threads_source

    return {
        "event": event,
        "from_round": from_round,
        "time": datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": shlex.join(sys.argv),
        "cwd": os.getcwd(),
        "hostname": socket.gethostname(),
        "python": platform.python_version(),
        "pflkit": _version("pflkit"),
        "components": component_versions(cfg),
        "git": git_commit(),
        "torch": torch.__version__,
        "libraries": library_versions(),
        "plugins": plugin_versions(),
        "threads": threads,
        "threads_setting": cfg.get("threads"),
        "threads_source": threads_source(cfg),
        **device_info(device),
        **{key: value for key, value in (("placement", _env_record(ENV_PLACEMENT)), ("job", _env_record(ENV_JOB)))
           if value is not None},
    }


def read(run_dir: Path) -> List[Dict[str, Any]]:
    """The entries recorded so far ([] when none, or when the file is unreadable: it is a record, not an input)."""
    try:
        doc = json.loads((Path(run_dir) / RUN_INFO_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    entries = doc.get("entries") if isinstance(doc, dict) else None
    return list(entries) if isinstance(entries, list) else []


def append(run_dir: Path, entry: Dict[str, Any]) -> None:
    """Add ``entry`` to ``run_info.json`` (written to a temporary file first, so a kill never leaves half a file)."""
    path = Path(run_dir) / RUN_INFO_NAME
    entries = read(run_dir) + [entry]
    from ..common.safefiles import write_atomic  # never through a link planted in the run directory

    write_atomic(path, json.dumps({"entries": entries}, indent=2))
