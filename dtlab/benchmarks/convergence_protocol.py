"""The convergence protocol behind docs/compression.md: recipes chosen on the validation split,
figures reported on the held-out test split, 3 seeds, raw results written beside the plots.

    # 1. selection, seed 0, validation split only (one process per learning rate runs in parallel)
    .venv/bin/python -m dtlab.benchmarks.convergence_protocol select --task digits
    .venv/bin/python -m dtlab.benchmarks.convergence_protocol select --task lm --lrs 0.5 &
    .venv/bin/python -m dtlab.benchmarks.convergence_protocol select --task lm --lrs 1.0
    # 2. the chosen recipe on every sparse algorithm at 1% and 2%, one process per seed
    .venv/bin/python -m dtlab.benchmarks.convergence_protocol test --task lm --seed 0   # and 1, 2
    # 3. the tables (markdown) and the plots, from the JSON files only
    .venv/bin/python -m dtlab.benchmarks.convergence_protocol report

How a recipe is chosen (``choose``), from validation figures only: the learning rate whose dense run
is best (dense is tuned first, as anyone would; ``--dense-only`` measures just that at a learning
rate); then, at that learning rate, among the warm-up
recipes whose worst sparse gap to dense is within the target (3% perplexity, 1 accuracy point), the
one that sends the fewest bytes over the whole run; if none is within the target, the smallest worst
gap (ties: the smaller mean gap, then the fewer bytes). The test split is never read to choose
anything.

Raw results: ``docs/results/convergence/<task>_select_*.json`` and ``<task>_test_seed<N>.json``:
every run's recipe, validation and test figure, densities, bytes, and the training loss per
iteration (averaged over the ranks).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from dtlab.benchmarks.convergence import OTHERS, SPARSE, SPARSE_EXTRA, plot, run

RESULTS = Path("docs") / "results" / "convergence"  # in the checkout, where this is run from
TARGET = {"lm": 3.0, "digits": 1.0}  # % perplexity over dense; accuracy points under dense

#: the grid searched on the validation split: learning rates, and warm-up recipes as
#: (name, dense warm-up epochs, ramp epochs, momentum correction)
GRID: dict[str, dict[str, Any]] = {
    "digits": {
        "epochs": 20,
        "lrs": [0.02, 0.05, 0.1],
        "recipes": [
            ("1 epoch dense", 1.0, 0.0, False),
            ("1 epoch dense, corrected momentum", 1.0, 0.0, True),
            ("2 epochs dense, corrected momentum", 2.0, 0.0, True),
        ],
        "algorithms": SPARSE,
    },
    "lm": {
        "epochs": 16,
        "lrs": [0.5, 1.0],
        "recipes": [
            ("2 epochs dense", 2.0, 0.0, True),
            ("20 iterations dense + 2-epoch ramp", 20 / 117, 2.0, True),
        ],
        "algorithms": ["topka", "gtopk", "oktopk"],
    },
}


def namespace(task: str, **kw: Any) -> argparse.Namespace:
    base: dict[str, Any] = {
        "world": 4, "densities": [0.01], "algorithms": [], "epochs": GRID[task]["epochs"], "seed": 0,
        "batch": None, "hidden": 128, "corpus_bytes": 300_000, "lr": None, "momentum": None,
        "tau": None, "schedule": None, "momentum_correction": None, "warmup": None, "ramp": None,
        "warmup_epochs": None, "ramp_epochs": None, "dense": True,
    }  # fmt: skip
    base.update(kw)
    return argparse.Namespace(**base)


def slim(rows: list[dict[str, Any]], recipe: str | None = None) -> list[dict[str, Any]]:
    """Rows as written to disk: the loss curve rounded, the recipe's name added."""
    out = []
    for r in rows:
        r = dict(r, losses=[float(f"{v:.5g}") for v in r["losses"]])
        if recipe is not None:
            r["recipe_name"] = recipe
        out.append(r)
    return out


def gap(task: str, value: float | None, dense: float) -> float:
    """How much worse than dense: % perplexity (lm), accuracy points (digits); diverged: inf."""
    if value is None:
        return float("inf")
    return (value / dense - 1) * 100 if task == "lm" else dense - value


def select(args: argparse.Namespace) -> None:
    grid = GRID[args.task]
    for lr in args.lrs or grid["lrs"]:
        path = RESULTS / f"{args.task}_select_lr{lr}.json"
        rows = slim(run(args.task, namespace(args.task, lr=lr, algorithms=[], world=args.world)), "dense")
        path.write_text(json.dumps(rows))  # after every run: a stopped selection keeps what it measured
        if args.dense_only:
            continue
        for name, warm, ramp, mc in grid["recipes"]:
            ns = namespace(
                args.task, lr=lr, algorithms=grid["algorithms"], dense=False, world=args.world,
                warmup_epochs=warm, ramp_epochs=ramp, momentum_correction=mc,
            )  # fmt: skip
            rows += slim(run(args.task, ns), name)
            path.write_text(json.dumps(rows))
        print(f"wrote {path}", flush=True)


def choose(task: str) -> dict[str, Any]:
    """The recipe of ``task`` from the selection files (validation figures only)."""
    rows = [r for f in sorted(RESULTS.glob(f"{task}_select_lr*.json")) for r in json.loads(f.read_text())]
    if not rows:
        raise SystemExit(f"no {RESULTS}/{task}_select_lr*.json: run `select --task {task}` first")
    return choose_from(task, rows)


def choose_from(task: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``choose`` on selection rows: reads ``val``, never ``final`` (the test split)."""
    dense = {r["recipe"]["lr"]: r["val"] for r in rows if r["algorithm"] == "dense"}
    better = min if task == "lm" else max
    lr = better(dense, key=lambda k: dense[k])
    table = []
    at_lr = [r for r in rows if r["recipe"]["lr"] == lr and r["algorithm"] != "dense"]
    if not at_lr:
        raise SystemExit(f"{task}: dense is best at lr {lr}; run `select --task {task} --lrs {lr}`")
    for name in dict.fromkeys(r["recipe_name"] for r in at_lr):
        runs = [r for r in at_lr if r["recipe_name"] == name]
        gaps = [gap(task, r["val"], dense[lr]) for r in runs]
        total = sum(r["total_bytes_sent"] for r in runs)
        table.append(
            {
                "name": name,
                "worst_val_gap": max(gaps),
                "mean_val_gap": sum(gaps) / len(gaps),
                "bytes": total,
                "recipe": runs[0]["recipe"],
            }
        )
    fits = [t for t in table if t["worst_val_gap"] <= TARGET[task]]
    if fits:
        best = min(fits, key=lambda t: t["bytes"])
    else:  # ties are common on a small validation split (digits: one image is 0.56 points)
        best = min(table, key=lambda t: (t["worst_val_gap"], t["mean_val_gap"], t["bytes"]))
    return {"lr": lr, "dense_val": dense, "recipes": table, "chosen": best}


def test(args: argparse.Namespace) -> None:
    chosen = choose(args.task)["chosen"]
    rec = chosen["recipe"]
    algorithms = args.algorithms or ([*SPARSE, *SPARSE_EXTRA, *OTHERS] if args.task == "digits" else SPARSE)
    ns = namespace(
        args.task, lr=rec["lr"], seed=args.seed, algorithms=algorithms, densities=[0.01, 0.02],
        warmup=rec["warmup"], ramp=rec["ramp"], momentum_correction=rec["momentum_correction"],
        world=args.world,
    )  # fmt: skip
    rows = slim(run(args.task, ns), chosen["name"])
    stored = RESULTS / f"{args.task}_test_seed{args.seed}.json"
    path = args.out or stored
    path.write_text(json.dumps(rows))
    print(f"wrote {path}", flush=True)
    if args.out is not None and stored.exists():  # a re-run: every figure next to the stored one
        compare(rows, json.loads(stored.read_text()), args.task)


def compare(rows: list[dict[str, Any]], stored: list[dict[str, Any]], task: str) -> None:
    """Print each re-run figure (test split) and bytes next to the stored run's."""
    print("| algorithm | density | test figure (stored) | (re-run) | bytes (stored) | bytes (re-run) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        key = (r["algorithm"], r["density"])
        old = next((o for o in stored if (o["algorithm"], o["density"]) == key), None)
        if old is None:
            continue
        print(
            f"| {r['algorithm']} | {r['density']} | {fmt(task, old['final'])} | {fmt(task, r['final'])} | "
            f"{old['total_bytes_sent']} | {r['total_bytes_sent']} |"
        )


def fmt(task: str, v: float | None) -> str:
    return "diverged" if v is None else (f"{v:.3f}" if task == "lm" else f"{v:.2f} %")


def row(
    task: str, alg: str, density: float, per_seed: list[tuple[list[dict[str, Any]], dict[str, Any]]]
) -> str:
    """One markdown row of the test table: the figure on every seed (its difference to dense on the
    same seed), the mean and the worst difference, and the bytes over the run as a share of dense's."""
    unit = "%" if task == "lm" else " points"
    cells: list[str] = []
    diffs: list[float | None] = []
    shares: list[float] = []
    for rows, dense in per_seed:
        r = next((r for r in rows if (r["algorithm"], r["density"]) == (alg, density)), None)
        if r is None:
            cells.append("-")
            continue
        shares.append(r["total_bytes_sent"] / dense["total_bytes_sent"] * 100)
        if r["final"] is None:
            cells.append("diverged")
            diffs.append(None)
            continue
        diff = (
            -gap(task, r["final"], dense["final"])
            if task == "digits"
            else gap(task, r["final"], dense["final"])
        )
        diff = round(diff, 2) + 0.0  # no "-0.00"
        diffs.append(diff)
        cells.append(fmt(task, r["final"]) + ("" if alg == "dense" else f" ({diff:+.2f}{unit})"))
    finite = [x for x in diffs if x is not None]
    mean = worst = ""
    if alg != "dense" and finite:
        mean = f"{round(sum(finite) / len(finite), 2) + 0.0:+.2f}{unit}"
        worst = f"{(max if task == 'lm' else min)(finite):+.2f}{unit}"
    if None in diffs:
        worst = "diverged"
    share = f"{sum(shares) / len(shares):.1f} %" if shares else "-"
    dens = "-" if density == 1.0 else f"{density:.0%}"
    return f"| {alg} | {dens} | {' | '.join(cells)} | {mean} | {worst} | {share} |"


def report(args: argparse.Namespace) -> None:
    for task in ("digits", "lm"):
        if not list(RESULTS.glob(f"{task}_select_lr*.json")):
            continue
        c = choose(task)
        unit = "%" if task == "lm" else " points"
        print(f"\n## {task}: selection on the validation split (seed 0)\n")
        print(
            "dense, by learning rate: "
            + ", ".join(f"lr {k}: {fmt(task, v)}" for k, v in c["dense_val"].items())
        )
        print(f"chosen learning rate: {c['lr']}\n")
        print(
            "| recipe | worst validation gap | mean validation gap | bytes over the run (rank 0, all runs) |"
        )
        print("|---|---|---|---|")
        for t in c["recipes"]:
            mark = " (chosen)" if t["name"] == c["chosen"]["name"] else ""
            print(
                f"| {t['name']}{mark} | {t['worst_val_gap']:+.2f}{unit} worse | "
                f"{t['mean_val_gap']:+.2f}{unit} worse | {t['bytes'] / 1e6:.1f} MB |"
            )
        seeds = {int(f.stem.rsplit("seed", 1)[1]): json.loads(f.read_text())
                 for f in sorted(RESULTS.glob(f"{task}_test_seed*.json"))}  # fmt: skip
        if not seeds:
            continue
        order = sorted(seeds)
        print(f"\n## {task}: the chosen recipe on the test split, seeds {order}\n")
        head = " | ".join(f"seed {s}" for s in order)
        print(f"| algorithm | density | {head} | mean gap | worst gap | bytes over the run vs dense |")
        print("|---|---|" + "---|" * len(order) + "---|---|---|")
        dense = {s: next(r for r in seeds[s] if r["algorithm"] == "dense") for s in order}
        for alg, d in [(r["algorithm"], r["density"]) for r in seeds[order[0]]]:
            print(row(task, alg, d, [(seeds[s], dense[s]) for s in order]))
        if args.plots:
            plot(seeds[order[0]], task, args.out_dir / f"compression_{task}_loss.png")
            print(f"\nplot: {args.out_dir / f'compression_{task}_loss.png'} (seed {order[0]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="stage", required=True)
    s = sub.add_parser("select", help="the grid on the validation split, seed 0")
    s.add_argument("--task", choices=list(GRID), required=True)
    s.add_argument("--lrs", type=float, nargs="+", default=None, help="a part of the grid's learning rates")
    s.add_argument("--world", type=int, default=4)
    s.add_argument(
        "--dense-only",
        action="store_true",
        help="only dense at each learning rate: the learning rate is chosen on dense alone, so the "
        "compressed runs matter only at the chosen one",
    )
    t = sub.add_parser("test", help="the chosen recipe on the test split, one seed")
    t.add_argument("--task", choices=list(GRID), required=True)
    t.add_argument("--seed", type=int, required=True)
    t.add_argument("--algorithms", nargs="+", default=None)
    t.add_argument("--world", type=int, default=4)
    t.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the rows here instead of the results folder, and print them next to the stored run",
    )
    r = sub.add_parser("report", help="markdown tables and plots from the JSON files")
    r.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--out-dir", type=Path, default=Path("docs/img"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    RESULTS.mkdir(parents=True, exist_ok=True)
    {"select": select, "test": test, "report": report}[args.stage](args)


if __name__ == "__main__":
    main()
