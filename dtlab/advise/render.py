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

from dtlab.advise.precision import Precision
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
    precision: Precision | None = None,
    given_rank: int | None = None,
) -> Table:
    """One row per plan; with ``given_rank`` the first row is the given plan, at that place."""
    tied = ", tied embeddings" if spec.tied_embeddings else ""
    shown = len(predictions) - (1 if given_rank is not None else 0)
    what = f"the {shown} fastest of {fitting} plans that fit ({considered} considered)"
    if given_rank is not None:
        what = (
            f"the given plan (place {given_rank} of {fitting} plans that fit; {considered} considered) "
            f"and the {shown} fastest"
        )
    title = (
        f"dtlab advise: {spec.name} ({spec.parameters / 1e6:,.1f}M parameters, L={spec.layers} "
        f"h={spec.hidden} a={spec.heads} V={spec.vocab} s={spec.seq_len}{tied}), "
        f"{(precision or Precision()).name}, global batch {global_batch}, {cluster.ranks} ranks "
        f"({cluster.ranks_per_node}/node, {cluster.memory_gib:g} GiB, {cluster.tflops:g} TFLOP/s): {what}"
    )
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    big = any(p.memory.total >= 2**30 for p in predictions)
    unit, unit_name = (2**30, "GiB") if big else (2**20, "MiB")
    for name, justify in [
        ("#", "right"),
        ("plan", "left"),
        ("runs", "left"),
        ("mb", "right"),
        ("step ms", "right"),
        ("compute ms", "right"),
        ("bubble", "right"),
        ("wait ms", "right"),
        (f"mem {unit_name}", "right"),
        (f"build {unit_name}", "right"),
        ("params", "right"),
        ("grads", "right"),
        ("optim", "right"),
        ("acts", "right"),
        ("transient", "right"),
        ("recompute", "right"),
        ("dp MB", "right"),
        ("tp MB", "right"),
        ("pp MB", "right"),
    ]:
        t.add_column(name, justify=justify, no_wrap=name != "plan")  # type: ignore[arg-type]
    for i, p in enumerate(predictions, 1):
        m = p.memory
        place = str(i if given_rank is None else i - 1)
        if given_rank is not None and i == 1:
            place = f"{given_rank} (given)"
        wait = sum(a.exposed for a in p.axes.values())
        t.add_row(
            place,
            p.candidate.label,
            "yes" if p.runnable else "not yet",
            str(p.micro_batch),
            f"{1e3 * p.step_seconds:,.2f}",
            f"{1e3 * p.compute_seconds:,.2f}",
            f"{100 * p.bubble:.0f}%" if p.candidate.pp > 1 else "-",
            f"{1e3 * wait:,.2f}",
            _size(m.total, unit),
            f"{p.init} {_size(p.construction, unit)}",
            *(
                _size(n, unit)
                for n in (
                    m.parameters,
                    m.gradients,
                    m.optimizer_state,
                    m.activations,
                    m.transient,
                    m.recompute,
                )
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
    precision: Precision | None = None,
    given: tuple[Prediction, int] | None = None,
) -> str:
    """The plans (and a given plan with its place, 0 when it cannot run) as one JSON document."""
    doc: dict[str, Any] = {
        "model": {**asdict(spec), "parameters": spec.parameters},
        "cluster": asdict(cluster),
        "precision": asdict(precision or Precision()),
        "global_batch": global_batch,
        "considered": considered,
        "fitting": fitting,
    }
    if given is not None:
        doc["plan"] = {**given[0].to_dict(), "place": given[1]}
    doc["plans"] = [p.to_dict() for p in predictions]
    return json.dumps(doc, indent=2)


def print_table(table: Table, file: TextIO | None = None) -> None:
    """Styled on a terminal, plain text (no escape codes) into pipes and files; never cut to 80 columns."""
    out = file or sys.stdout
    console = Console(file=out, highlight=False, width=None if out.isatty() else 200)
    console.print(table)
