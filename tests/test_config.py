import json

import pytest

from pflkit.core.engine.config import load_file, parse_sets, resolve
from pflkit.core.common.errors import ConfigError, UnknownNameError
from pflkit.core.api.params import parse_value


def test_layer_precedence_core_algorithm_file_set():
    # core default lr 0.05, fedavg default 0.05; file says 0.2; --set says 0.3 and wins
    cfg = resolve([{"train": {"lr": 0.2, "batch_size": 7}}, parse_sets(["train.lr=0.3"])], algorithm="fedavg")
    assert cfg.train.lr == 0.3 and cfg.train.batch_size == 7
    assert cfg.train.local_epochs == 1  # default filled in
    assert cfg.trainer.name == "fedavg" and cfg.aggregator.name == "fedavg"


def test_unknown_keys_are_rejected_with_suggestion():
    with pytest.raises(ConfigError, match=r"unknown key 'train.lrr'.*Did you mean 'lr'"):
        resolve([parse_sets(["train.lrr=0.1"])], algorithm="fedavg")
    with pytest.raises(ConfigError, match=r"unknown key 'roundz'.*Did you mean 'rounds'"):
        resolve([{"roundz": 3}], algorithm="fedavg")
    with pytest.raises(ConfigError, match=r"unknown key 'model.hiden'.*Did you mean 'hidden'"):
        resolve([{"model": {"name": "mlp", "hiden": [3]}}], algorithm="fedavg")


def test_component_keys_depend_on_the_chosen_component():
    cfg = resolve([{"partition": {"name": "pathological", "classes_per_client": 3}}], algorithm="fedavg")
    assert cfg.partition.classes_per_client == 3 and "alpha" not in cfg.partition
    with pytest.raises(ConfigError, match="partition.alpha"):
        resolve([{"partition": {"name": "iid", "alpha": 0.5}}], algorithm="fedavg")


@pytest.mark.parametrize("sets, fragment", [
    (["train.lr=-1"], "train.lr: -1.0 is invalid: must be > 0"),
    (["rounds=abc"], "rounds: expected int"),
    (["train.optimizer=rmsprop"], "train.optimizer: 'rmsprop' is not one of"),
    (["participation.join_ratio=1.5"], "participation.join_ratio"),
    (["participation.random_join_ratio=[0.5,0.2]"], "low <= high"),
    (["split.train_size=10"], "must be given together"),
    (["split.fraction=0"], "split.fraction"),
    (["split.fraction=0.5", "split.train_size=10", "split.test_size=5"], "exclude each other"),
    (["train.lr"], "expected key=value"),
])
def test_invalid_values_name_the_key_and_reason(sets, fragment):
    with pytest.raises(ConfigError) as err:
        resolve([parse_sets(sets)], algorithm="fedavg")
    assert fragment in str(err.value)


def test_unknown_component_name_lists_options():
    with pytest.raises(UnknownNameError, match="Available: .*mlp"):
        resolve([{"model": {"name": "resnet999"}}], algorithm="fedavg")


def test_protocol_mismatch_is_a_clear_error():
    with pytest.raises(ConfigError, match="protocol"):
        resolve([{"trainer": {"name": "local"}}], algorithm="fedavg")


def test_algorithm_defaults_for_a_replaced_component_are_dropped(registries_snapshot):
    from pflkit.core import Algorithm, LocalSGDTrainer, Param

    class T(LocalSGDTrainer):
        params = {**LocalSGDTrainer.params, "mu": Param(0.5, "test")}

    registries_snapshot.TRAINERS.register("t_with_mu", T)
    registries_snapshot.ALGORITHMS.register("algo_mu", Algorithm("t_with_mu", "fedavg",
                                                                 defaults={"trainer": {"mu": 0.9}}))
    assert resolve([], algorithm="algo_mu").trainer.mu == 0.9
    cfg = resolve([{"trainer": {"name": "fedavg"}}], algorithm="algo_mu")
    assert "mu" not in cfg.trainer


def test_parse_value_and_files(tmp_path):
    assert parse_value("0.5") == 0.5 and parse_value("[0.1, 1]") == [0.1, 1]
    assert parse_value("true") is True and parse_value("null") is None and parse_value("abc") == "abc"
    # "none" is a value where a key does not accept null, and null where it does
    assert resolve([parse_sets(["aggregator.name=none", "trainer.name=local"])], algorithm="fedavg").aggregator.name == "none"
    assert resolve([parse_sets(["run_name=none"])], algorithm="fedavg").run_name is None
    toml = tmp_path / "c.toml"
    toml.write_text('rounds = 4\n[train]\nlr = 0.01\n')
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"rounds": 5}))
    assert resolve([load_file(toml)], algorithm="fedavg").rounds == 4
    assert resolve([load_file(js)], algorithm="fedavg").rounds == 5
    bad = tmp_path / "bad.toml"
    bad.write_text("rounds = = 3")
    with pytest.raises(ConfigError, match="cannot be parsed"):
        load_file(bad)
    with pytest.raises(ConfigError, match="does not exist"):
        load_file(tmp_path / "missing.toml")
