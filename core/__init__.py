"""pflkit core: the public API that plugins build on.

Everything a plugin needs is importable from here (``from pflkit.core import ClientTrainer, Param, ...``), and
the helpers of a plugin's tests from ``pflkit.core.testing``; the modules below are the core's own and move
freely. ``__all__`` lists the public API. Names are imported on first use, so ``import pflkit.core`` (and the
``fl`` command's start) costs only what is used.

The core is grouped by layer, each folder importing only the layers below it (``tests/test_layering.py``):
``common`` < ``api`` < ``data`` < ``storage`` < ``engine`` < ``results`` < ``distributed`` < ``cli``, with
``testing`` and this module on top (see each folder's ``__init__`` for what it owns).
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, List

from . import cli_start  # noqa: F401  (first: a Ctrl-C while the fl command imports torch exits 130, no traceback)

# public name -> the module that defines it (relative to pflkit.core, or absolute for pflkit's bundled components)
_EXPORTS: Dict[str, str] = {
    # what a plugin implements
    "Algorithm": ".api.algorithm",
    "ClientTrainer": ".api.client", "LocalSGDTrainer": ".api.client", "ClientContext": ".api.client",
    "ServerAggregator": ".api.server", "GlobalModelAggregator": ".api.server", "ServerContext": ".api.server",
    "SetupStep": ".api.server", "SharedArtifacts": ".api.artifacts",
    "Param": ".api.params", "positive": ".api.params", "non_negative": ".api.params",
    "unit_interval": ".api.params", "open_unit_interval": ".api.params", "Space": ".api.space",
    "Task": ".api.task", "classification": ".api.task", "regression": ".api.task",
    "AdaptationSettings": ".api.adaptation",
    # messages between clients and server
    "Message": ".api.protocol", "BitMask": ".api.protocol", "payload_nbytes": ".api.protocol",
    "iter_tensors": ".api.protocol",
    # model state and training helpers
    "State": ".api.state", "load_into": ".api.state", "clone_state": ".api.state", "proximal_term": ".api.state",
    "weighted_average": ".api.state", "WeightedMean": ".api.state", "bn_keys": ".api.state",
    "module_keys": ".api.state",
    "BN_PARAM": ".api.client", "feature_keys": ".api.client", "head_keys": ".api.client",
    "host_copy": ".api.client", "state_declared": ".api.client",
    "TensorData": ".api.training", "evaluate": ".api.training", "make_optimizer": ".api.training",
    "minibatches": ".api.training", "run_sgd": ".api.training", "clip_gradients": ".api.training",
    "fold_mean": ".api.fold", "Layout": ".api.fold", "layout_of": ".api.fold",
    "BatchedForm": ".api.batching", "BatchedPhase": ".api.batching", "StepInputs": ".api.batching",
    "BatchedFormError": ".api.batching",
    "trained_names": ".api.batching",
    "ServerClientStore": ".api.serverstore", "same_state": ".api.clientstate",
    "derive_seed": ".common.seeding",
    # registries
    "ALGORITHMS": ".api.registry", "TRAINERS": ".api.registry", "AGGREGATORS": ".api.registry",
    "DATASETS": ".api.registry", "PARTITIONERS": ".api.registry", "MODELS": ".api.registry",
    "ALL_REGISTRIES": ".api.registry", "TABLES": ".api.registry",
    # errors
    "PflError": ".common.errors", "ConfigError": ".common.errors", "DataError": ".common.errors",
    "PluginError": ".common.errors", "UnknownNameError": ".common.errors", "CheckpointError": ".common.errors",
    # data, runs and results
    "DatasetBundle": ".data.data", "FederatedData": ".data.data", "build_federated_data": ".data.data",
    "Simulation": ".engine.simulation",
    "per_client_metric": ".engine.evaluation",
    "log_matrix_figure": ".results.figures",
    "run_comparison": ".results.compare",
    # the contracts of pflkit's bundled models and data sets that plugins build on
    "SplitModel": "pflkit.models.base", "flat_size": "pflkit.models.base",
    "client_clusters": "pflkit.datasets.clustered",
}

__all__: List[str] = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later look-ups are plain attribute reads
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
