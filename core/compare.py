"""Run several algorithms on the same dataset, partition and seeds; tabulate and plot the results.

``run_comparison(["fedavg", "fedprox"], [0, 1, 2], layers, out_dir)`` runs every (algorithm, seed) pair with the
same user layers (file and ``--set`` overrides; ``seed`` is then set per run), each in
``out_dir/runs/<algorithm>-seed<k>``, and writes

- ``results.json``: per run the summary numbers, per algorithm mean and std over seeds;
- ``results.md``: the same as a Markdown table;
- ``curves.png``: the uniform and sample-weighted test metric per evaluated round, one curve per algorithm
  (mean over seeds, shaded band = std over seeds).

Std over seeds is the population std (numpy's default, ddof=0), as PFLlib reports it. A run directory that already
holds a finished run with the identical configuration is reused instead of rerun, and an interrupted one (Ctrl-C
leaves a checkpoint) is resumed, so an interrupted or extended comparison picks up where it stopped; a run
directory of a different configuration is an error.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from .checkpoint import CHECKPOINT_NAME
from .config import resolve, to_plain
from .errors import CheckpointError, ConfigError

log = logging.getLogger("pflkit")

STATS = ("final_uniform", "best_uniform", "final_weighted")


def _mean_std(values: Sequence[float]) -> Dict[str, float]:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {"mean": math.nan, "std": math.nan, "n": 0}
    return {"mean": float(arr.mean()), "std": float(arr.std()), "n": int(arr.size)}


def _read_curve(run_dir: Path, metric: str) -> Dict[str, List[float]]:
    """Evaluated rounds and their uniform / weighted metric from a run's ``metrics.jsonl``."""
    rounds, uniform, weighted = [], [], []
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        if not line.strip():
            continue
        row = json.loads(line)
        if f"{metric}/uniform" in row:
            rounds.append(int(row["round"]))
            uniform.append(float(row[f"{metric}/uniform"]))
            weighted.append(float(row.get(f"{metric}/weighted", math.nan)))
    return {"rounds": rounds, "uniform": uniform, "weighted": weighted}


def _existing_run(run_dir: Path, cfg: Mapping[str, Any]) -> Optional[str]:
    """What ``run_dir`` holds for ``cfg``: None (nothing), 'finished' (reuse it) or 'resume' (an interrupted run of
    the same configuration with a checkpoint). Anything else is an error: it is never silently overwritten."""
    if not run_dir.exists():
        return None
    try:
        same_config = json.loads((run_dir / "config.json").read_text()) == to_plain(cfg)
    except (OSError, json.JSONDecodeError):
        same_config = False
    summary = None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        pass
    if same_config:
        if summary is not None and not summary.get("interrupted") \
                and summary.get("rounds_completed") == cfg["rounds"]:
            return "finished"
        if (run_dir / CHECKPOINT_NAME).exists():
            return "resume"
    raise CheckpointError(f"{run_dir} already exists and is neither a finished run nor a resumable checkpoint of "
                          f"the same configuration; remove it or choose another --out folder")


def _plan(algorithms: Sequence[str], seeds: Sequence[int], layers: Sequence[Mapping[str, Any]],
          algorithm_layers: Mapping[str, Sequence[Mapping[str, Any]]]):
    if not algorithms:
        raise ConfigError("compare: name at least one algorithm (--plugins fedavg,fedprox)")
    if len(set(algorithms)) != len(algorithms):
        raise ConfigError(f"compare: an algorithm is listed twice in {', '.join(algorithms)}")
    if not seeds:
        raise ConfigError("compare: give at least one seed (--seeds 0,1,2)")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"compare: a seed is listed twice in {', '.join(map(str, seeds))}")
    stray = sorted(set(algorithm_layers) - set(algorithms))
    if stray:
        raise ConfigError(f"compare: settings given for '{stray[0]}', which is not among the compared "
                          f"algorithms ({', '.join(algorithms)})")
    # resolve everything before running anything: a typo must not surface after an hour of training
    plan = {}
    for algo in algorithms:
        for seed in seeds:
            try:
                plan[algo, seed] = resolve([*layers, *algorithm_layers.get(algo, ()), {"seed": int(seed)}],
                                           algorithm=algo)
            except ConfigError as exc:  # name the algorithm: a key may exist for one trainer and not another
                raise ConfigError(f"{algo}: {exc} (a key for one algorithm only: --set {algo}:KEY=VALUE)") from None
    return plan


def run_comparison(algorithms: Sequence[str], seeds: Sequence[int], layers: Sequence[Mapping[str, Any]],
                   out_dir: Path, progress: bool = False,
                   algorithm_layers: Optional[Mapping[str, Sequence[Mapping[str, Any]]]] = None) -> Dict[str, Any]:
    """Run every algorithm with every seed on the same configuration layers; write results and plots.

    ``layers`` (file, ``--set``) apply to every algorithm; ``algorithm_layers[name]`` only to that algorithm
    (e.g. ``trainer.mu`` for fedprox, a key the other trainers do not have). Returns the content of
    ``results.json`` plus the written file paths under ``files``.
    """
    from .simulation import Simulation

    out_dir = Path(out_dir)
    plan = _plan(list(algorithms), [int(s) for s in seeds], list(layers), dict(algorithm_layers or {}))
    runs_root = out_dir / "runs"
    try:
        runs_root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {runs_root}: {exc.strerror}") from exc

    per_algo: Dict[str, Dict[str, Any]] = {a: {"runs": []} for a in algorithms}
    metric, interrupted = None, False
    for (algo, seed), cfg in plan.items():
        run_dir = runs_root / f"{algo}-seed{seed}"
        state = _existing_run(run_dir, cfg)
        if state == "finished":
            log.info("compare: reusing the finished run in %s", run_dir)
            summary = json.loads((run_dir / "summary.json").read_text())
        elif state == "resume":
            log.info("compare: resuming the interrupted run in %s", run_dir)
            summary = Simulation.resume(run_dir, tensorboard=False, progress=progress).run()
        else:
            log.info("compare: running %s with seed %d in %s", algo, seed, run_dir)
            summary = Simulation(cfg, run_dir=run_dir, tensorboard=False, progress=progress).run()
        if metric is None:
            metric = summary["metric"]
        entry = per_algo[algo]
        entry.setdefault("model", cfg.model.name)
        entry.setdefault("trainer", cfg.trainer.name)
        entry.setdefault("aggregator", cfg.aggregator.name)
        entry["runs"].append({
            "seed": seed, "run_dir": str(run_dir),
            "final_uniform": summary["final"]["uniform"], "final_weighted": summary["final"]["weighted"],
            "best_uniform": summary["best"]["uniform"], "best_round": summary["best"]["round"],
            "final_k": summary["final"]["k"], "rounds_completed": summary["rounds_completed"],
            "bytes_up_total": summary["bytes_up_total"], "curve": _read_curve(run_dir, summary["metric"]),
        })
        if summary.get("interrupted"):
            interrupted = True
            break

    for entry in per_algo.values():
        for stat in STATS:
            entry[stat] = _mean_std([r[stat] for r in entry["runs"]])
        entry["bytes_up_total"] = _mean_std([r["bytes_up_total"] for r in entry["runs"]])
    first_cfg = next(iter(plan.values()))
    models = {e["model"] for e in per_algo.values() if e["runs"]}
    notes = []
    if len(models) > 1:
        notes.append("the algorithms' defaults use different models (" + ", ".join(
            f"{a}: {e['model']}" for a, e in per_algo.items() if e["runs"]) + "); set model.name to compare "
            "on one model")
    results: Dict[str, Any] = {
        "metric": metric or "accuracy", "algorithms": list(algorithms), "seeds": [int(s) for s in seeds],
        "dataset": first_cfg.dataset.name, "partition": to_plain(first_cfg.partition),
        "rounds": first_cfg.rounds,
        "final_k": max((r["final_k"] for e in per_algo.values() for r in e["runs"]), default=first_cfg.eval.final_k), "std": "population std over seeds (ddof=0)",
        "interrupted": interrupted, "notes": notes, "results": per_algo,
    }
    files = {"json": out_dir / "results.json", "markdown": out_dir / "results.md", "plot": out_dir / "curves.png"}
    files["json"].write_text(json.dumps(results, indent=2))
    files["markdown"].write_text(results_markdown(results))
    plot_curves(results, files["plot"])
    results["files"] = {k: str(v) for k, v in files.items()}
    return results


def _fmt(stat: Mapping[str, float], percent: bool) -> str:
    if stat["n"] == 0 or math.isnan(stat["mean"]):
        return "n/a"
    if percent:
        return f"{100 * stat['mean']:.2f} ± {100 * stat['std']:.2f}"
    return f"{stat['mean']:.4f} ± {stat['std']:.4f}"


def results_markdown(results: Mapping[str, Any]) -> str:
    """The results table: one row per algorithm, mean ± std over seeds (percent for accuracy)."""
    metric = results["metric"]
    percent = metric == "accuracy"
    unit = " (%)" if percent else ""
    lines = [
        f"# Comparison on {results['dataset']} ({results['partition']['name']} partition, "
        f"{results['partition']['num_clients']} clients, {results['rounds']} rounds)",
        "",
        f"Seeds: {', '.join(map(str, results['seeds']))}. Each cell: mean ± {results['std']}. "
        f"Final = mean of the last {results['final_k']} evaluations; uniform = mean over clients of each "
        f"client's {metric}; weighted = pooled over all test samples; best = best uniform evaluation.",
        "",
        f"| algorithm | final {metric}, uniform{unit} | best {metric}, uniform{unit} | "
        f"final {metric}, weighted{unit} | model | runs | upload per run (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for algo in results["algorithms"]:
        e = results["results"][algo]
        up = e["bytes_up_total"]
        up_text = "n/a" if up["n"] == 0 else f"{up['mean'] / 2 ** 20:.2f}"
        lines.append(f"| {algo} | {_fmt(e['final_uniform'], percent)} | {_fmt(e['best_uniform'], percent)} | "
                     f"{_fmt(e['final_weighted'], percent)} | {e.get('model', 'n/a')} | {len(e['runs'])} | "
                     f"{up_text} |")
    for note in results.get("notes", []):
        lines += ["", f"Note: {note}."]
    if results.get("interrupted"):
        lines += ["", "Note: the comparison was interrupted; rows cover the runs that finished."]
    return "\n".join(lines) + "\n"


def _mean_band(curves: Sequence[Mapping[str, List[float]]], key: str):
    """Mean and std over seeds on the rounds every seed evaluated."""
    common = sorted(set.intersection(*(set(c["rounds"]) for c in curves))) if curves else []
    if not common:
        return [], np.array([]), np.array([])
    stacked = np.array([[dict(zip(c["rounds"], c[key]))[r] for r in common] for c in curves], dtype=np.float64)
    return common, stacked.mean(axis=0), stacked.std(axis=0)


def plot_curves(results: Mapping[str, Any], path: Path) -> None:
    """PNG with the uniform and weighted metric per round: one line per algorithm, std band over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    metric = results["metric"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, key in zip(axes, ("uniform", "weighted")):
        for i, algo in enumerate(results["algorithms"]):
            runs = results["results"][algo]["runs"]
            rounds, mean, std = _mean_band([r["curve"] for r in runs], key)
            if not rounds:
                continue
            # line styles cycle too, so coinciding curves (e.g. FedProx with a tiny mu over FedAvg) stay visible
            line, = ax.plot(rounds, mean, marker="o" if len(rounds) < 15 else None, markersize=3,
                            linestyle=("-", "--", "-.", ":")[i % 4], label=f"{algo} (n={len(runs)})")
            if len(runs) > 1:
                ax.fill_between(rounds, mean - std, mean + std, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_title(f"test {metric}, " + ("mean over clients" if key == "uniform" else "pooled over test samples"))
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(metric)
    axes[0].legend(loc="best", fontsize=8)
    fig.suptitle(f"{results['dataset']}: mean over seeds {', '.join(map(str, results['seeds']))} "
                 f"(band: std)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
