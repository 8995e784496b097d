"""Argument checks of :class:`~dtlab.backends.base.CommunicationBackend`: every public operation
validates its arguments here before any communication, and raises :class:`ArgumentError` /
:class:`ArgumentTypeError` naming the values and the fix."""

from __future__ import annotations

import torch

from dtlab.backends._engine import Engine
from dtlab.backends.types import SUPPORTED_DTYPES, ReduceOp
from dtlab.errors import ArgumentError, ArgumentTypeError, integer

__all__ = ["ArgumentChecks"]

_AVG = ReduceOp.AVG
_SUPPORTED = frozenset(SUPPORTED_DTYPES)


class ArgumentChecks(Engine):
    """The ``_check_*`` methods (a part of ``CommunicationBackend``; an engine may extend them)."""

    def _check_tensor(self, t: object, op: str, name: str = "tensor") -> None:
        if not isinstance(t, torch.Tensor):
            raise ArgumentTypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _SUPPORTED:
            raise ArgumentTypeError(
                f"{op}: {name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            )
        if not t.is_contiguous():
            raise ArgumentError(f"{op}: {name} must be contiguous (call .contiguous() first)")

    def _check_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> None:
        self._check_pair(output, input, "reduce_scatter")
        if input.numel() != self._world_size * output.numel():
            raise ArgumentError(
                f"reduce_scatter: input has {input.numel()} elements but needs world_size * "
                f"output.numel() = {self._world_size} * {output.numel()} = "
                f"{self._world_size * output.numel()}; pad the input to a multiple of the world size"
            )
        self._check_op(output, op, "reduce_scatter")

    def _check_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check_pair(output, input, "all_gather")
        if output.numel() != self._world_size * input.numel():
            raise ArgumentError(
                f"all_gather: output has {output.numel()} elements but needs world_size * "
                f"input.numel() = {self._world_size} * {input.numel()} = "
                f"{self._world_size * input.numel()}"
            )

    def _check_pair(self, output: torch.Tensor, input: torch.Tensor, op: str) -> None:
        """An output and an input tensor of one dtype."""
        self._check_tensor(output, op, "output")
        self._check_tensor(input, op, "input")
        if output.dtype != input.dtype:
            raise ArgumentTypeError(
                f"{op}: output dtype {output.dtype} differs from input dtype {input.dtype}"
            )

    def _check_root(self, root: object, op: str, name: str) -> int:
        """``root`` as a Python int (NumPy's integers taken, as torch takes them; a bool is no rank)."""
        value = integer(root)
        if value is None or not 0 <= value < self._world_size:
            raise ArgumentError(f"{op}: {name}={root!r} must be a rank, an int in [0, {self._world_size})")
        return value

    def _check_peer(self, peer: object, op: str, name: str) -> int:
        value = self._check_root(peer, op, name)
        if value == self._rank:
            raise ArgumentError(f"{op}: {name}={peer!r} is this rank itself; send to another rank")
        return value

    def _check_op(self, t: torch.Tensor, op: ReduceOp, where: str) -> None:
        if op.__class__ is not ReduceOp:
            raise ArgumentTypeError(f"{where}: op must be a dtlab.backends.ReduceOp, got {op!r}")
        if op is _AVG and not t.is_floating_point():
            raise ArgumentTypeError(
                f"{where}: ReduceOp.AVG needs a floating-point tensor, got {t.dtype}; "
                "use SUM and divide, or cast to float"
            )

    def _check_split(self, color: object, key: object) -> tuple[int | None, int]:
        """``(color, key)`` as Python ints (NumPy's integers taken; a bool refused)."""
        c = None if color is None else integer(color)
        if color is not None and (c is None or not 0 <= c < 2**31):
            raise ArgumentError(
                f"split: color={color!r} must be None (not a member) or an int in [0, 2**31) "
                "(MPI's colors are non-negative C ints)"
            )
        k = integer(key)
        if k is None or not -(2**31) <= k < 2**31:
            raise ArgumentError(f"split: key={key!r} must be an int in [-2**31, 2**31) (a C int)")
        return c, k
