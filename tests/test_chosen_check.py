"""``fl reproduce --check`` fails a table whose ``[[chosen]]`` entry contradicts what the table sets (issue 37):
a dotted setting must name the values the table's cells take at the paper's scale."""
from __future__ import annotations

import dataclasses

import pytest

from pflkit.core import ConfigError
from pflkit.core.results.chosen import check_chosen, names_value, setting_keys
from pflkit.core.testing import installed_table


def _with_chosen(name: str, *entries):
    table = installed_table(name)
    return dataclasses.replace(table, chosen=[{"setting": s, "value": v, "why": "test"} for s, v in entries])


def test_setting_keys_and_value_matching():
    assert setting_keys("partition.min_size, partition.min_rule") == ["partition.min_size", "partition.min_rule"]
    assert setting_keys("test rows") == [] and setting_keys("L2GD's aggregator.p") == []
    assert names_value("momentum 0.5, weight decay 1e-5", 1e-05) and not names_value("weight decay 1e-4", 1e-05)
    assert names_value("hidden = [120, 64]", [120, 64]) and not names_value("FC 384-192", [120, 64])
    assert names_value("within_class = true", True) and not names_value("box", "exact")


def test_a_chosen_value_the_table_does_not_set_is_refused():
    # fedcp:table2 sets partition.min_size = 40 in its Dir(0.1) columns: the entry it had before said 10
    table = _with_chosen("fedcp:table2", ("partition.min_size", "10 (pflkit's default)"))
    with pytest.raises(ConfigError, match=r"says .10 \(pflkit's default\).?, but the table sets partition.min_size = 40 \(row fedavg"):
        check_chosen(table)
    check_chosen(_with_chosen("fedcp:table2", ("partition.min_size, partition.min_rule", "40 by PFLlib's rule (pfllib)")))


def test_a_chosen_key_no_cell_has_is_refused():
    with pytest.raises(ConfigError, match="names trainer.no_such_option, which no cell of the table has"):
        check_chosen(_with_chosen("pcfl:table3", ("trainer.no_such_option", "1")))


def test_every_installed_table_passes():
    for name in ("pcfl:table1", "pcfl:table2", "pcfl:table3", "fedcp:table2", "fedsa:table1", "fedcac:table1",
                 "fedcac:table2", "fedc2i:table1", "fedc2i:table2"):
        check_chosen(installed_table(name))
