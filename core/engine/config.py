"""Layered configuration: core defaults < algorithm defaults < file < ``--set``.

Components (dataset, partitioner, model, trainer, aggregator) each own a config section named after their kind;
the keys allowed in a section are the core's common keys for it plus the parameters the chosen component
declares. So ``trainer.mu`` exists only when the trainer is FedProx, and a typo anywhere is rejected with a
did-you-mean instead of being silently ignored.
"""
from __future__ import annotations

import copy
import hashlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from easydict import EasyDict

from ..common.errors import ConfigError, PflError, did_you_mean
from ..api.space import Space
from ..api.params import (Param, ParamSpec, non_negative, open_unit_interval, parse_value, plain_name, positive,
                          ratio_range, seed_range, thread_count)
from ..common import strictjson
from . import compose
from ..api import registry as reg

# Bounds that keep a run finite (issue 29: an adaptation of 10**12 steps or a 1,000,000-layer model was accepted and
# never finished). Stated in ``fl show core``; far above any published setting (PFLlib fine-tunes 1-10 epochs; the
# largest model here has 11 million parameters)
MAX_ADAPT_STEPS = 100_000
MAX_ADAPT_EPOCHS = 1_000
MAX_MODEL_PARAMETERS = 2 ** 30  # checked on a model built without memory (torch's meta device) before the real one
MAX_MODEL_LIST_ENTRIES = 1_000


def _at_most(v: Any, limit: int) -> Optional[str]:
    if v <= 0:
        return "must be > 0"
    return None if v <= limit else f"must be at most {limit:,}"


def _size(v: Any) -> Optional[str]:
    from ..api.clientstate import parse_size
    try:
        parse_size(v)
    except ConfigError:
        return "not a size (examples: 512MiB, 1GiB, 1000000)"
    return None


# Core keys: sections with fixed keys ------------------------------------------------------------------------
CORE_SCHEMA: Dict[str, Any] = {
    "algorithm": Param("fedavg", "algorithm plugin: picks the default trainer, aggregator and their defaults"),
    "seed": Param(0, "seed of every RNG in the run (partition, init, sampling, batches)", check=seed_range),
    "rounds": Param(30, "number of communication rounds", check=positive),
    "device": Param("auto", "torch device: auto (cuda when available), cpu, cuda, cuda:N"),
    "threads": Param(None, "torch CPU threads of the run (results depend on it); null: the process's setting -- the fl "
                           "command sets 1 unless OMP_NUM_THREADS is set, fastest on a shared machine "
                           "(docs: Performance, Threads)",
                     type=int, check=thread_count),
    "output_dir": Param("runs", "folder that receives one sub-folder per run"),
    "run_name": Param(None, "run sub-folder name, a plain folder name (default: <algorithm>-<dataset>-<timestamp>)",
                      type=str, check=plain_name),
    "participation": {
        "join_ratio": Param(1.0, "fraction of clients selected each round", check=open_unit_interval),
        "random_join_ratio": Param(None, "[low, high]: draw each round's join ratio uniformly from this range "
                                         "(drop-out experiments); overrides join_ratio", type=list, check=ratio_range),
    },
    "train": {
        "optimizer": Param("sgd", "client optimizer", choices=("sgd", "adam")),
        "lr": Param(0.05, "client learning rate", check=positive,
                    space=Space.real(0.001, 0.5, log=True)),
        "momentum": Param(0.0, "SGD momentum", check=non_negative),
        "weight_decay": Param(0.0, "L2 weight decay", check=non_negative),
        "max_grad_norm": Param(None, "clip each local step's gradient to this total 2-norm (None: no clipping)",
                               type=float, check=positive),
        "batch_size": Param(32, "client mini-batch size", check=positive),
        "local_epochs": Param(1, "local epochs per round", check=positive,
                              space=Space.integer(1, 5)),
        "eval_batch_size": Param(1024, "batch size for evaluation", check=positive),
        "drop_last": Param(False, "drop each epoch's last incomplete mini-batch (PyTorch's DataLoader drop_last; "
                                  "a client with fewer samples than batch_size still takes one step)"),
    },
    "eval": {
        "every": Param(1, "evaluate all clients every N rounds (and always after the last round)", check=positive),
        "final_k": Param(5, "'final' metric = mean of the last k evaluations", check=positive),
        "adapt": Param("never", "evaluation-time adaptation: fine-tune a scratch copy of each client's evaluated "
                                "model on its training split before scoring it, at every evaluation, only the last "
                                "final_k (those the 'final' metric averages), or never (docs: Evaluation protocol)",
                       choices=("never", "every", "final")),
        "adapt_steps": Param(None, "adaptation length in SGD steps (mini-batches of train.batch_size), 1 to "
                                   f"{MAX_ADAPT_STEPS:,}; give this or adapt_epochs (default with neither: 1 epoch)",
                             type=int, check=lambda v: _at_most(v, MAX_ADAPT_STEPS)),
        "adapt_epochs": Param(None, "adaptation length in epochs of the client's training split, 1 to "
                                    f"{MAX_ADAPT_EPOCHS:,}", type=int, check=lambda v: _at_most(v, MAX_ADAPT_EPOCHS)),
        "adapt_lr": Param(None, "adaptation learning rate (default: the trainer's, train.lr for most)", type=float,
                          check=positive),
        "adapt_params": Param("all", "parameters adapted: all, head, body (features), or a set the trainer "
                                     "declares (adapt_param_sets)"),
    },
    "checkpoint": {
        "every": Param(5, "write a checkpoint every N rounds (and after the last round); 0 disables periodic ones",
                       check=non_negative),
        "final": Param(True, "write a checkpoint after the last round (false: with every=0, none at all)"),
    },
    "clients": {
        "state_memory": Param(None, "host memory for declared client states, e.g. 512MiB, 1GiB or bytes (default: "
                                    "no limit); the rest spills to <run>/client_state", check=_size),
        "batched": Param("auto", "train a round's clients as one vectorised model (docs/batched-clients.md): auto = on "
                                 "CUDA for trainers with a batched form, one after another on CPU (CPU numbers stay "
                                 "as published); on = always (a trainer that cannot batch is an error); off = never",
                         choices=("auto", "on", "off")),
        "stack": Param(None, "most clients stacked in one batched group (default: all on CPU; on CUDA as many as "
                             "half the free device memory holds)", type=int, check=positive),
    },
    "server": {
        "state_memory": Param(None, "host memory for the server's per-client stores (e.g. FedAMP's uploaded models), "
                                    "e.g. 512MiB (default: no limit); the rest spills to <run>/server_state",
                              check=_size),
    },
    "failures": {
        "on_client_error": Param("skip", "a client whose code raises: skip it this round, or abort the run",
                                 choices=("skip", "abort")),
        "rollback": Param(True, "restore a failed or rejected client's state to before the call"),
        "client_timeout": Param(None, "seconds one client call may take; a call past it fails like a client that "
                                      "raised (docs: Concepts, Failures); a call that cannot be interrupted ends "
                                      "the run after twice as long (at least 5 s more), resumable; null: no limit",
                                type=float, check=lambda v: None if v == v and 0 < v <= 2592000 else
                                "must be a number of seconds > 0 and at most 2592000 (30 days)"),
    },
    "distributed": {
        "exact": Param(True, "multi-process runs: true sums uploads in one canonical client order (the serial run's "
                             "exact numbers); false lets an aggregator that needs only the weighted mean of uploads "
                             "(FedAvg) all-reduce per-rank partial sums: far less traffic, last-digit differences"),
        "backend": Param("auto", "multi-process runs: what carries the all-reduce of device tensors (the fast path): "
                                 "nccl (CUDA GPUs only), gloo, or auto (nccl when the run computes on CUDA GPUs); "
                                 "replies and states always travel pickled over gloo",
                         choices=("auto", "gloo", "nccl")),
    },
    "split": {
        "test_ratio": Param(0.25, "per-client test fraction (stratified by label)", check=open_unit_interval),
        "train_size": Param(None, "fixed train samples per client (with test_size; overrides test_ratio)", type=int),
        "test_size": Param(None, "fixed test samples per client (with train_size)", type=int),
        "test": Param("stratified", "how each client's test split is chosen: stratified (split.test_ratio of its "
                                    "samples, by label) or dataset (its samples in the dataset's own test set, e.g. "
                                    "Adult's adult.test; the dataset must mark them)",
                      choices=("stratified", "dataset")),
        "val": Param(0.0, "hold out this stratified share of each client's training samples (at least one) as its "
                          "validation split, scored beside the test split at each evaluation (val_* metrics, the "
                          "validation-selected round: docs/evaluation.md); 0: none, the split of earlier versions",
                     type=float, check=lambda v: None if 0 <= v < 1 else "must lie in [0, 1)"),
        "fraction": Param(1.0, "keep this stratified fraction of each client's samples before the train/test split "
                               "(smaller, faster experiments with the partition's skew and client sizes kept)",
                          check=open_unit_interval, type=float),
    },
}

# Sections whose keys are: common keys + the chosen component's declared params.
COMPONENT_SECTIONS: Dict[str, Tuple[reg.Registry, ParamSpec]] = {
    "dataset": (reg.DATASETS, {
        "name": Param("digits", "dataset name (fl list datasets)"),
        "root": Param(None, "folder of the data files (unset: $PFLKIT_DATA if not empty, else ./data)", type=str),
        "download": Param(False, "true: download missing files from the dataset's site (needs internet)"),
    }),
    "partition": (reg.PARTITIONERS, {
        "name": Param("dirichlet", "partitioner name (fl list partitioners)"),
        "num_clients": Param(20, "number of clients", check=positive),
        "seed": Param(None, "seed of the partition and per-client split (default: the run seed); fix it to "
                            "compare run seeds on one partition", type=int, check=seed_range),
    }),
    "model": (reg.MODELS, {
        "name": Param("cnn4", f"model name (fl list models); any model: at most {MAX_MODEL_PARAMETERS:,} "
                              f"parameters, and a list option (e.g. mlp's hidden widths) at most "
                              f"{MAX_MODEL_LIST_ENTRIES:,} entries"),
        "init_seed": Param(None, "seed of the initial weights, independent of the run seed (default: the run seed; "
                                 "init_seed=s gives the initial weights of a run with seed=s)", type=int,
                           check=seed_range),
    }),
    "trainer": (reg.TRAINERS, {
        "name": Param("fedavg", "client trainer (set by the algorithm; override to combine freely)"),
    }),
    "aggregator": (reg.AGGREGATORS, {
        "name": Param("fedavg", "server aggregator (set by the algorithm; override to combine freely)"),
    }),
}


def component_params(obj: Any) -> ParamSpec:
    """The hyperparameters a component declares (``params`` attribute; may be absent)."""
    return dict(getattr(obj, "params", None) or {})


# Merging ---------------------------------------------------------------------------------------------------
def deep_merge(base: Dict[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    """A deep copy of ``base`` with ``over`` merged in: nested mappings merge key by key, anything else replaces."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_sets(items: Iterable[str]) -> Dict[str, Any]:
    """``["train.lr=0.1", "participation.random_join_ratio=[0.1,1]"]`` -> nested dict."""
    out: Dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. train.lr=0.01")
        key, _, text = item.partition("=")
        key = key.strip()
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"--set {item!r}: empty key")
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set {key}: '{p}' is set both as a value and as a section")
            node = nxt
        try:
            node[parts[-1]] = parse_value(text)
        except strictjson.StrictJSONError as exc:
            raise ConfigError(f"--set {key}: the value is refused: {exc}") from None
    return out


def load_file(path: str | Path) -> Dict[str, Any]:
    """Read a TOML or JSON config file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(p)!r} is not UTF-8 text (byte {exc.start}); save it as UTF-8 TOML or "
                          f"JSON") from None
    except OSError as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        if p.suffix == ".json":
            data = strictjson.loads(text)  # a key given twice is refused, not silently the last one
        else:
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover
                import tomli as tomllib
            data = tomllib.loads(text)  # TOML itself refuses a key given twice
            strictjson.check_depth(data)
    except Exception as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be parsed: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must contain a table/object at the top level")
    return data


def core_defaults() -> Dict[str, Any]:
    def _defaults(spec: Mapping[str, Any]) -> Dict[str, Any]:
        return {k: (_defaults(v) if isinstance(v, Mapping) else v.default) for k, v in spec.items()}

    out = _defaults(CORE_SCHEMA)
    for section, (_, common) in COMPONENT_SECTIONS.items():
        out[section] = {"name": common["name"].default}
    return out


# Validation ------------------------------------------------------------------------------------------------
def _validate_section(prefix: str, values: Mapping[str, Any], spec: Mapping[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for key, value in values.items():
        full = f"{prefix}{key}"
        if key not in spec:
            known = ", ".join(sorted(spec)) or "(none)"
            raise ConfigError(f"unknown key '{full}'.{did_you_mean(key, spec)} Valid keys here: {known}")
        rule = spec[key]
        if isinstance(rule, Mapping):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{full}: expected a section (table), got {value!r}")
            out[key] = _validate_section(full + ".", value, rule)
        else:
            out[key] = rule.validate(full, value)
    for key, rule in spec.items():  # fill defaults
        if key not in out:
            out[key] = (_validate_section(f"{prefix}{key}.", {}, rule) if isinstance(rule, Mapping)
                        else copy.deepcopy(rule.default))
    return out


def resolve(layers: List[Mapping[str, Any]], algorithm: Optional[str] = None) -> EasyDict:
    """Merge the user layers over core and algorithm defaults, then validate every key.

    ``layers`` are file and ``--set`` overlays in increasing precedence; ``algorithm`` (from ``--plugin``)
    outranks them all.
    """
    user: Dict[str, Any] = {}
    for layer in layers:
        user = deep_merge(user, layer)
    user = _partition_from(user)
    if algorithm is not None:
        user["algorithm"] = algorithm
    algo_name = user.get("algorithm", CORE_SCHEMA["algorithm"].default)
    if not isinstance(algo_name, str):
        raise ConfigError(f"algorithm: expected a name, got {algo_name!r}")
    algo = reg.ALGORITHMS.get(algo_name)
    algo_defaults = copy.deepcopy(dict(getattr(algo, "defaults", {}) or {}))
    algo_defaults.setdefault("trainer", {}).setdefault("name", algo.trainer)
    algo_defaults.setdefault("aggregator", {}).setdefault("name", algo.aggregator)
    algo_defaults = _with_dataset_defaults(algo_defaults, user)

    # An algorithm's defaults for a component section only apply while that component stays the one the
    # algorithm chose: switching ``trainer.name`` must not drag the old trainer's keys along.
    for section in COMPONENT_SECTIONS:
        chosen = user.get(section, {}).get("name") if isinstance(user.get(section), Mapping) else None
        algo_sec = algo_defaults.get(section)
        if chosen is not None and algo_sec is not None and algo_sec.get("name", chosen) != chosen:
            algo_defaults[section] = {"name": chosen}

    merged = deep_merge(deep_merge(core_defaults(), algo_defaults), user)
    # an algorithm augmenting another (compose.py): the base algorithm's defaults go beneath the wrapper's own
    comp = _composition(merged)
    if comp is not None and comp.wrapped:
        upper = deep_merge(algo_defaults, user)
        merged = deep_merge(deep_merge(core_defaults(), _unswitched(compose.base_defaults(comp), upper)), upper)

    unknown_top = set(merged) - set(CORE_SCHEMA) - set(COMPONENT_SECTIONS)
    if unknown_top:
        key = sorted(unknown_top)[0]
        valid = sorted(set(CORE_SCHEMA) | set(COMPONENT_SECTIONS))
        raise ConfigError(f"unknown key '{key}'.{did_you_mean(key, valid)} Valid top-level keys: {', '.join(valid)}")

    out: Dict[str, Any] = _validate_section("", {k: v for k, v in merged.items() if k in CORE_SCHEMA}, CORE_SCHEMA)
    for section, (registry, common) in COMPONENT_SECTIONS.items():
        values = merged.get(section, {})
        if not isinstance(values, Mapping):
            raise ConfigError(f"{section}: expected a section with at least 'name', got {values!r}")
        name = values.get("name", common["name"].default)
        if not isinstance(name, str):
            raise ConfigError(f"{section}.name: expected a name, got {name!r}")
        out[section] = _validate_section(section + ".", values,
                                         _component_spec(section, common, registry.get(name), comp))
    _check_model_lists(out["model"])
    _check_cross_field(out)
    return EasyDict(out)


def _component_spec(section: str, common: ParamSpec, component: Any, comp: Any) -> ParamSpec:
    """A component section's keys: the common ones (``name``, ...) and those its component declares (through the
    composition when one algorithm augments another)."""
    spec = dict(common)
    spec.update(compose.section_params(section, component, comp) if comp is not None
                else component_params(component))
    return spec


def declared_params(cfg: Mapping[str, Any]) -> Dict[str, Param]:
    """Every option of a resolved configuration by its dotted key (``train.lr``, ``trainer.mu``), with the ``Param``
    that declares it: what ``fl tune`` reads search ranges from and checks ``--space`` against."""
    out: Dict[str, Param] = {}

    def walk(prefix: str, spec: Mapping[str, Any]) -> None:
        for key, rule in spec.items():
            if isinstance(rule, Mapping):
                walk(f"{prefix}{key}.", rule)
            else:
                out[f"{prefix}{key}"] = rule

    walk("", CORE_SCHEMA)
    comp = _composition(cfg)
    for section, (registry, common) in COMPONENT_SECTIONS.items():
        walk(section + ".", _component_spec(section, common, registry.get(cfg[section]["name"]), comp))
    return out


def _with_dataset_defaults(algo_defaults: Dict[str, Any], user: Mapping[str, Any]) -> Dict[str, Any]:
    """The chosen dataset's ``defaults`` (what its inputs need, e.g. a text set's model and natural partition) laid
    over the algorithm's: an algorithm's default model is an image model, which cannot read tabular rows or
    characters. A section whose component the dataset changes drops the algorithm's keys for the old component;
    the user's file and --set values still outrank both."""
    chosen = user.get("dataset") if isinstance(user.get("dataset"), Mapping) else {}
    name = chosen.get("name", (algo_defaults.get("dataset") or {}).get("name",
                                                                      COMPONENT_SECTIONS["dataset"][1]["name"].default))
    if not isinstance(name, str):
        return algo_defaults
    extra = copy.deepcopy(dict(getattr(reg.DATASETS.get(name), "defaults", None) or {}))
    for section, values in extra.items():
        if section in COMPONENT_SECTIONS and isinstance(values, Mapping) and values.get("name") is not None:
            if (algo_defaults.get(section) or {}).get("name") != values["name"]:
                algo_defaults[section] = {}
    return deep_merge(algo_defaults, extra)


def _partition_from(user: Dict[str, Any]) -> Dict[str, Any]:
    """``partition.from=RUN_DIR_OR_FILE`` is short for ``partition.name=from_file`` + ``partition.path=...``: the
    saved configuration then names the partitioner that really made the split."""
    part = user.get("partition")
    if not isinstance(part, Mapping):
        return user
    part = dict(part)
    if "from" in part:
        source = part.pop("from")
        if not isinstance(source, str) or not source:
            raise ConfigError(f"partition.from: expected a run directory or a partition file, got {source!r}")
        if part.get("name", "from_file") != "from_file":
            raise ConfigError(f"partition.from reuses a saved split; it cannot be combined with "
                              f"partition.name={part['name']!r}")
        if "path" in part:
            raise ConfigError("partition.from and partition.path name the same file; give one of them")
        part.update(name="from_file", path=source)
    if part.get("name") == "from_file" and "num_clients" not in part and isinstance(part.get("path"), str):
        count = _clients_in_split(part["path"])
        if count is not None:  # the file decides how many clients there are; the partitioner checks the rest
            part["num_clients"] = count
    return {**user, "partition": part}


PARTITION_LIMIT = 1 << 30  # bytes of a partition file read (about 100 million sample indices)


def _clients_in_split(path: str) -> Optional[int]:
    """Number of clients in a saved split (a run directory means its partition.json); None when unreadable."""
    p = Path(path).expanduser()
    p = p / "partition.json" if p.is_dir() else p
    try:
        from ..common.safefiles import read_regular  # a FIFO or device there must not hang or fill memory

        clients = strictjson.loads(read_regular(p, PARTITION_LIMIT).decode("utf-8")).get("clients")
    except (OSError, ValueError, AttributeError, PflError):  # the partitioner reports it in one line
        return None
    return len(clients) if isinstance(clients, list) and clients else None


def _composition(merged: Mapping[str, Any]) -> Optional["compose.Composition"]:
    """The trainer/aggregator composition of a merged config, or None while its sections are malformed (the
    section validation then reports them)."""
    sections = [merged.get(s) for s in compose.SECTIONS]
    if not all(isinstance(s, Mapping) and isinstance(s.get("name"), str) for s in sections):
        return None
    if sections[0]["name"] not in reg.TRAINERS.names() or sections[1]["name"] not in reg.AGGREGATORS.names():
        return None
    return compose.composition(merged)


def _unswitched(lower: Dict[str, Any], upper: Mapping[str, Any]) -> Dict[str, Any]:
    """``lower`` without the component sections whose ``name`` ``upper`` switches to another component."""
    out = dict(lower)
    for section in COMPONENT_SECTIONS:
        low, up = out.get(section), upper.get(section)
        if isinstance(low, Mapping) and isinstance(up, Mapping) and "name" in low and \
                up.get("name", low["name"]) != low["name"]:
            out.pop(section)
    return out


def _check_model_lists(model: Mapping[str, Any]) -> None:
    """A model's list options (layer widths, channels) have at most MAX_MODEL_LIST_ENTRIES entries: building a
    model of a million layers never finishes, whatever its parameter count."""
    for key, value in model.items():
        if isinstance(value, (list, tuple)) and len(value) > MAX_MODEL_LIST_ENTRIES:
            raise ConfigError(f"model.{key}: {len(value):,} entries is invalid: a model's list option may have at "
                              f"most {MAX_MODEL_LIST_ENTRIES:,}")


def _check_cross_field(cfg: Mapping[str, Any]) -> None:
    split = cfg["split"]
    if (split["train_size"] is None) != (split["test_size"] is None):
        raise ConfigError("split.train_size and split.test_size must be given together")
    for key in ("train_size", "test_size"):
        if split[key] is not None and split[key] <= 0:
            raise ConfigError(f"split.{key}: must be > 0")
    if split.get("test", "stratified") == "dataset" and split["train_size"] is not None:
        raise ConfigError("split.test=dataset and split.train_size/test_size exclude each other: the dataset's own "
                          "test set chooses each client's test samples")
    if split["train_size"] is not None and split["fraction"] != 1.0:
        raise ConfigError("split.fraction and split.train_size/test_size exclude each other: fixed sizes already "
                          "choose how many samples a client keeps")
    from ..api import adaptation  # here, not at import: it needs torch, which `fl --help` does not (cli/main.py)

    comp = compose.composition(cfg)  # wrappers resolved: the classes the run will build
    adaptation.check_trainer(comp.trainer, adaptation.settings_from_config(cfg), cfg["trainer"]["name"])
    tp, ap = getattr(comp.trainer, "protocol", None), getattr(comp.aggregator, "protocol", None)
    if tp != ap:
        raise ConfigError(
            f"trainer '{cfg['trainer']['name']}' speaks protocol {tp!r} but aggregator "
            f"'{cfg['aggregator']['name']}' expects {ap!r}; pick a matching pair (fl show NAME tells each protocol)")


# Resuming -------------------------------------------------------------------------------------------------
# Keys a resumed run may change (``fl run --resume DIR --set key=value``): they extend or observe a run without
# changing what has been computed so far. Every other key is fixed by the checkpoint's configuration hash.
# ``threads`` may change too, with a warning: later rounds then differ in the last digits (see Simulation.resume).
RESUME_SAFE_KEYS = ("rounds", "eval.every", "eval.final_k", "checkpoint.every", "failures.on_client_error",
                    "failures.client_timeout",
                    "threads", "checkpoint.final", "clients.state_memory", "distributed.backend",
                    "server.state_memory", "clients.stack")
# Where a run lives is not part of what it computes: a run directory may be moved or renamed.
LOCATION_KEYS = ("output_dir", "run_name")
# Keys added after checkpoints existed: at these values they compute what the configuration computed before the
# key existed, so the fingerprint leaves them out and older run directories stay resumable.
NEUTRAL_DEFAULTS: Dict[str, Any] = {"train.drop_last": False, "model.init_seed": None, "dataset.normalize": "standard",
                                    "eval.adapt": "never", "eval.adapt_steps": None, "eval.adapt_epochs": None,
                                    "eval.adapt_lr": None, "eval.adapt_params": "all",
                                    "failures.client_timeout": None, "aggregator.weighting": "samples",
                                    "model.projection_dim": 0, "server.state_memory": None,
                                    "split.fraction": 1.0, "clients.batched": "auto", "split.test": "stratified",
                                    # options added later to a dataset or partitioner (issue 37): absent from older runs
                                    "partition.min_rule": "move", "partition.class_draw": "deal",
                                    "partition.within_class": False,
                                    "dataset.features": "all", "dataset.test_path": None, "dataset.categories": None,
                                    "dataset.comment": None}


def without_neutral_defaults(plain: Dict[str, Any]) -> Dict[str, Any]:
    """``plain`` (a JSON-able configuration, changed in place and returned) without the NEUTRAL_DEFAULTS keys that
    hold their neutral value: a run made before such a key existed compares equal to one made after."""
    for key, neutral in NEUTRAL_DEFAULTS.items():
        node = plain
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict) and node.get(parts[-1], neutral) == neutral:
            node.pop(parts[-1], None)
            if not node and len(parts) == 2 and plain.get(parts[0]) is node:  # a section added with the key
                plain.pop(parts[0])
    return plain


def _flat_keys(tree: Mapping[str, Any], prefix: str = "") -> List[str]:
    out: List[str] = []
    for k, v in tree.items():
        full = f"{prefix}{k}"
        out += _flat_keys(v, full + ".") if isinstance(v, Mapping) else [full]
    return out


def check_resume_overrides(sets: Mapping[str, Any]) -> None:
    """Only ``RESUME_SAFE_KEYS`` may be changed on resume; anything else is a ConfigError naming the key."""
    for key in _flat_keys(sets):
        if key not in RESUME_SAFE_KEYS:
            raise ConfigError(f"--set {key}: cannot change on resume (it would change what the run computed so "
                              f"far); keys that may change: {', '.join(RESUME_SAFE_KEYS)}")


def config_fingerprint(cfg: Mapping[str, Any]) -> str:
    """SHA-256 of the configuration minus the resume-safe and location keys (what a checkpoint must match)."""
    plain = without_neutral_defaults(to_plain(cfg))
    for key in RESUME_SAFE_KEYS + LOCATION_KEYS:
        node = plain
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.get(p, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    for key in NEUTRAL_DEFAULTS:  # a section that came with a neutral key (server) is absent from older runs
        section = key.split(".")[0]
        if "." in key and plain.get(section) == {}:
            plain.pop(section)
    return hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()


def to_plain(cfg: Mapping[str, Any]) -> Dict[str, Any]:
    """EasyDict -> plain JSON-able dict."""
    return json.loads(json.dumps(cfg, default=lambda o: list(o) if isinstance(o, tuple) else str(o)))
