"""``dtlab advise`` output: a rich table (plain text when not on a terminal) or JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, TextIO

from rich import box
from rich.console import Console
from rich.table import Table

from dtlab.advise.predict import Prediction
from dtlab.advise.spec import ClusterSpec, ModelSpec

__all__ = ["advice_json", "advice_table", "print_table"]


def _size(n: int, unit: int) -> str:
    return "0" if n == 0 else f"{n / unit:,.2f}"


def _mb(n: int) -> str:
    return "-" if n == 0 else f"{n / 1e6:,.1f}"


def advice_table(
    predictions: Sequence[Prediction],
    spec: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    considered: int,
    fitting: int,
) -> Table:
    title = (
        f"dtlab advise: {spec.name} ({spec.parameters / 1e6:,.1f}M parameters, L={spec.layers} "
        f"h={spec.hidden} a={spec.heads} V={spec.vocab} s={spec.seq_len}), global batch {global_batch}, "
        f"{cluster.ranks} ranks "
        f"({cluster.ranks_per_node}/node, {cluster.memory_gib:g} GiB, {cluster.tflops:g} TFLOP/s): "
        f"the {len(predictions)} fastest of {fitting} plans that fit ({considered} considered)"
    )
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    big = any(p.memory.total >= 2**30 for p in predictions)
    unit, unit_name = (2**30, "GiB") if big else (2**20, "MiB")
    for name, justify in [
        ("#", "right"),
        ("plan", "left"),
        ("runs", "left"),
        ("step ms", "right"),
        ("compute ms", "right"),
        ("bubble", "right"),
        (f"mem {unit_name}", "right"),
        ("params", "right"),
        ("grads", "right"),
        ("optim", "right"),
        ("acts", "right"),
        ("transient", "right"),
        ("dp MB", "right"),
        ("tp MB", "right"),
        ("pp MB", "right"),
    ]:
        t.add_column(name, justify=justify, no_wrap=name != "plan")  # type: ignore[arg-type]
    for i, p in enumerate(predictions, 1):
        m = p.memory
        t.add_row(
            str(i),
            p.candidate.label,
            "yes" if p.runnable else "not yet",
            f"{1e3 * p.step_seconds:,.2f}",
            f"{1e3 * p.compute_seconds:,.2f}",
            f"{100 * p.bubble:.0f}%" if p.candidate.pp > 1 else "-",
            *(
                _size(n, unit)
                for n in (m.total, m.parameters, m.gradients, m.optimizer_state, m.activations, m.transient)
            ),
            *(_mb(p.axes[a].bytes_sent) for a in ("dp", "tp", "pp")),
        )
    return t


def advice_json(
    predictions: Sequence[Prediction],
    spec: ModelSpec,
    cluster: ClusterSpec,
    global_batch: int,
    considered: int,
    fitting: int,
) -> str:
    doc: dict[str, Any] = {
        "model": {**asdict(spec), "parameters": spec.parameters},
        "cluster": asdict(cluster),
        "global_batch": global_batch,
        "considered": considered,
        "fitting": fitting,
        "plans": [p.to_dict() for p in predictions],
    }
    return json.dumps(doc, indent=2)


def print_table(table: Table, file: TextIO | None = None) -> None:
    """Styled on a terminal, plain text (no escape codes) into pipes and files; never cut to 80 columns."""
    out = file or sys.stdout
    console = Console(file=out, highlight=False, width=None if out.isatty() else 200)
    console.print(table)
