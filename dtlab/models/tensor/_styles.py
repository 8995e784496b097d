"""The tensor-parallel styles as objects (what :mod:`dtlab.models.tensor._plan` does to a module of
the plan), each refusing an option of the wrong kind when built (``gather_output='no'`` would be taken
as true)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dtlab.errors import StrategyError, check_switches

__all__ = [
    "ColwiseParallel",
    "HeadsParallel",
    "PlanDict",
    "RowwiseParallel",
    "SequenceParallel",
    "Style",
    "VocabParallel",
]


@dataclass(frozen=True)
class ColwiseParallel:
    """Output features split over tp (``sections``: fused equal parts, each split)."""

    gather_output: bool = False
    sequence_parallel: bool = False
    sections: int = 1

    def __post_init__(self) -> None:
        check_switches(
            "ColwiseParallel", gather_output=self.gather_output, sequence_parallel=self.sequence_parallel
        )


@dataclass(frozen=True)
class RowwiseParallel:
    """Input features split over tp; the output summed (or reduce-scattered along the sequence)."""

    input_is_parallel: bool = True
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        check_switches(
            "RowwiseParallel",
            input_is_parallel=self.input_is_parallel,
            sequence_parallel=self.sequence_parallel,
        )


@dataclass(frozen=True)
class VocabParallel:
    """Embedding rows (the vocabulary) split over tp."""

    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        check_switches("VocabParallel", sequence_parallel=self.sequence_parallel)


@dataclass(frozen=True)
class HeadsParallel:
    """An attention module with a fused projection laid out ``(sections, heads, head_dim)``.

    ``qkv``: the name(s) of its input projection(s) (one fused ``nn.Linear`` with ``sections=3``, or
    three with ``sections=1``); ``out``: its output projection; ``heads``: the attribute holding the
    head count, set to ``heads // tp`` (the forward must read it, or infer heads with ``-1``).
    """

    qkv: tuple[str, ...] = ("qkv",)
    out: str = "proj"
    heads: str = "n_heads"
    sections: int = 3
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.qkv, str):  # its characters would be taken as module names
            raise StrategyError(
                f"HeadsParallel(qkv=...) is a tuple of names, e.g. ({self.qkv!r},), got a str"
            )
        check_switches("HeadsParallel", sequence_parallel=self.sequence_parallel)

    def parts(self) -> list[tuple[str, ColwiseParallel | RowwiseParallel]]:
        """Its projections and the style each is split by: the input ones per head, the output by rows."""
        sp = self.sequence_parallel
        qkv = ColwiseParallel(sequence_parallel=sp, sections=self.sections)
        return [*((name, qkv) for name in self.qkv), (self.out, RowwiseParallel(sequence_parallel=sp))]


@dataclass(frozen=True)
class SequenceParallel:
    """A module of the sequence-parallel region (norms, dropout, position embeddings)."""

    split_output: bool = False

    def __post_init__(self) -> None:
        check_switches("SequenceParallel", split_output=self.split_output)


Style = ColwiseParallel | RowwiseParallel | VocabParallel | HeadsParallel | SequenceParallel
PlanDict = Mapping[str, "Style | str"]
