"""Which client-state backend ran -- one pooled trainer with declared states, or one live trainer per client -- is
said by ``fl show``, the run summary and run_info.json, with the reason (issue 36: a third-party author could not
tell)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from pflkit.core import FederatedData, LocalSGDTrainer, ServerAggregator  # noqa: F401  (public names exist)
from pflkit.core.api.client import client_state_backend
from pflkit.core.storage.reporting import format_summary
from pflkit.core.testing import cli, tiny_run


def test_a_run_records_its_client_state_backend(tmp_path):
    sim, summary = tiny_run("fedavg", tmp_path / "run", {"rounds": 1})
    assert summary["clients_state"]["path"] == "pooled"
    assert "declares its per-client state" in summary["clients_state"]["reason"]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["clients_state"] == summary["clients_state"]
    info = json.loads((tmp_path / "run" / "run_info.json").read_text())
    entries = info if isinstance(info, list) else info.get("entries", [info])
    assert entries[-1]["clients_state"] == summary["clients_state"]
    assert "client state" in format_summary(summary) and "pooled (" in format_summary(summary)


def test_an_undeclared_trainer_runs_one_trainer_per_client_and_says_why():
    class Undeclared(LocalSGDTrainer):
        pass

    class Declared(LocalSGDTrainer):
        declares_state = True

    plan = client_state_backend(Undeclared, ServerAggregator)
    assert plan["path"] == "one trainer per client" and "Undeclared does not declare" in plan["reason"]
    # a declared trainer that needs the shared state in every message, against a strategy that does not send it
    plan = client_state_backend(Declared, ServerAggregator)
    assert plan["path"] == "one trainer per client" and "does not send the shared state" in plan["reason"]


def test_fl_show_says_which_client_state_backend_runs():
    out = CliRunner().invoke(cli, ["show", "fedavg"]).output
    assert "client state: pooled (trainer FedAvgTrainer declares its per-client state" in out
    out = CliRunner().invoke(cli, ["show", "fedala"]).output  # the composed trainer (FedALA over its base) decides
    assert "client state: pooled (trainer FedALA[FedAvgTrainer] declares" in out
