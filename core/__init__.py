"""pflkit core: registries, configuration, round protocol, simulation, evaluation, monitoring, checkpoints.

The public API plugins build on is re-exported here.
"""
from . import cli_start  # noqa: F401  (first: a Ctrl-C while the fl command imports torch exits 130, no traceback)
from .algorithm import Algorithm
from .client import BN_PARAM, ClientContext, ClientTrainer, LocalSGDTrainer, feature_keys, head_keys
from .data import DatasetBundle, FederatedData, build_federated_data
from .errors import ConfigError, DataError, PflError, PluginError, UnknownNameError
from .params import Param
from .protocol import BitMask, Message, payload_nbytes
from .registry import AGGREGATORS, ALGORITHMS, DATASETS, MODELS, PARTITIONERS, TRAINERS
from .server import GlobalModelAggregator, ServerAggregator, ServerContext, SetupStep
from .serverstore import ServerClientStore
from .simulation import Simulation
from .task import Task, classification, regression
from .training import TensorData, evaluate, make_optimizer, minibatches, run_sgd

__all__ = [
    "Algorithm", "BN_PARAM", "ClientContext", "ClientTrainer", "LocalSGDTrainer", "feature_keys", "head_keys",
    "DatasetBundle", "FederatedData", "build_federated_data", "ConfigError", "DataError", "PflError",
    "PluginError", "UnknownNameError", "Param", "BitMask", "Message", "payload_nbytes", "AGGREGATORS",
    "ALGORITHMS", "DATASETS", "MODELS", "PARTITIONERS", "TRAINERS", "GlobalModelAggregator",
    "ServerAggregator", "ServerContext", "Simulation", "Task", "classification", "regression", "TensorData",
    "SetupStep", "ServerClientStore", "evaluate", "make_optimizer", "minibatches", "run_sgd",
]
