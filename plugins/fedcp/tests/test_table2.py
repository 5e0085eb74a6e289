"""fedcp:table2 (FedCP's Table 2 as a pflkit.tables file) is registered, complete and valid offline."""
from __future__ import annotations

from pflkit.core.api import registry as reg
from pflkit.core.results.tables import check_table, installed_table


def test_table2_registered_complete_and_valid():
    assert "fedcp:table2" in reg.TABLES.names()
    t = installed_table("fedcp:table2")
    assert [c.id for c in t.columns] == ["pa_mnist", "pa_cifar10", "pa_cifar100", "pr_mnist", "pr_cifar10",
                                         "pr_cifar100", "pr_tiny", "pr_tiny_resnet", "pr_agnews"]
    assert t.datasets()["pr_agnews"] == "ag_news"
    assert check_table(t) == 13 * 9
    # every cell of the paper has its number, exactly once between the two FedCP rows (lambda 5 and lambda 1)
    for row in t.rows:
        reported = [c.id for c in t.columns if t.numbers[row.id, c.id].mean is not None]
        if row.id == "fedcp":
            assert reported == [c.id for c in t.columns][:7]
        elif row.id == "fedcp_l1":
            assert reported == ["pr_tiny_resnet", "pr_agnews"]
        else:
            assert len(reported) == 9 and all(t.numbers[row.id, c].std is not None for c in reported)
    assert t.numbers["fedcp", "pr_cifar100"].mean == 59.56 and t.numbers["fedcp_l1", "pr_agnews"].std == 0.09
