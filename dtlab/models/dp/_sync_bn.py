"""torch's ``nn.SyncBatchNorm`` under a data-parallel strategy: batch statistics over the strategy's
data-parallel group through dtlab's collectives, so on every engine (in-memory, MPI, Gloo, NCCL):
torch's own layer synchronizes only when ``torch.distributed`` is initialized (over its WORLD group or
the ``process_group`` given, and only on GPUs), else it is a local BatchNorm. The wrapper that owns
the module (``_owner.py``: the newest) sets each layer's ``forward`` to a
:class:`DataParallelBatchNorm` of its dp group. See docs/strategies.md, "BatchNorm and SyncBatchNorm".
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import StrategyError

__all__ = ["DataParallelBatchNorm", "refuse_sync_batch_norm", "sync_batch_norms"]


class _SyncBatchNorm(torch.autograd.Function):
    """Batch normalization over the batches of every rank of ``group`` (torch's ``sync_batch_norm``
    with kernels every device has: torch's own exist for GPUs only). Forward all-gathers each rank's
    mean, variance and count, as torch does (ranks may hold unequal batches); backward all-reduces the
    sums of ``dy`` and ``dy * (x - mean)``."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor | None,
        bias: torch.Tensor | None,
        running_mean: torch.Tensor | None,
        running_var: torch.Tensor | None,
        eps: float,
        momentum: float,
        group: CommunicationBackend,
    ) -> torch.Tensor:
        channels, acc = x.shape[1], torch.float32 if x.element_size() < 4 else x.dtype
        count = x.numel() // max(channels, 1)
        local = torch.zeros(2 * channels + 1, dtype=acc, device=x.device)
        if count:  # an empty batch takes part with a count of 0
            var, mean = torch.var_mean(x.to(acc), [0, *range(2, x.dim())], correction=0)
            local = torch.cat([mean, var, local.new_full((1,), count)])
        rows = torch.empty(group.world_size * local.numel(), dtype=acc, device=x.device)
        group.all_gather(rows, local)
        means, variances, counts = rows.view(group.world_size, -1).split([channels, channels, 1], dim=1)
        total = float(counts.sum())
        if total <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {int(total)} over the "
                f"{group.world_size} ranks of the data-parallel group (input size {list(x.shape)} here)"
            )
        mean = (counts * means).sum(0) / total
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / total
        with torch.no_grad():
            if running_mean is not None and running_var is not None:
                running_mean.lerp_(mean.to(running_mean.dtype), momentum)
                running_var.lerp_((var * total / (total - 1)).to(running_var.dtype), momentum)
        ctx.save_for_backward(x, weight, mean, torch.rsqrt(var + eps))
        ctx.group, ctx.total = group, total
        return F.batch_norm(x, mean, var, weight, bias, False, 0.0, eps)  # normalized with these statistics

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: these gradients would hold no graph of x
            raise StrategyError(
                "nn.SyncBatchNorm under a data-parallel strategy has no second derivative: a backward that "
                "builds a graph (create_graph=True: a gradient penalty such as WGAN-GP's) would take its "
                "gradients for constants, a wrong penalty gradient. Use nn.BatchNorm (each rank's own "
                "statistics, as under torch's DDP) or a norm without batch statistics (nn.LayerNorm, "
                "nn.GroupNorm) there"
            )
        x, weight, mean, invstd = ctx.saved_tensors
        # this rank's sums of dy * (x - mean) * invstd and of dy: its weight and bias gradients
        dw, db = torch.zeros_like(mean), torch.zeros_like(mean)
        if x.numel():  # (the kernel divides by the count)
            _, dw, db = torch.ops.aten.native_batch_norm_backward(
                dy, x, weight, None, None, mean, invstd, True, 0.0, [False, True, True]
            )
        grad_w = grad_b = grad_x = None
        if weight is not None:  # this rank's part, averaged with the other gradients by the strategy
            grad_w = dw.to(weight.dtype, copy=True) if ctx.needs_input_grad[1] else None
            grad_b = db.to(weight.dtype, copy=True) if ctx.needs_input_grad[2] else None
        if ctx.needs_input_grad[0]:  # every rank alike: the same graph
            sums = torch.cat([db, dw / invstd])  # sum_dy, sum_dy_xmu
            ctx.group.all_reduce(sums)
            mean_dy, mean_dy_xmu = (sums / ctx.total).split(mean.numel())
            scale = invstd if weight is None else invstd * weight.to(invstd.dtype)
            slope = -scale * invstd * invstd * mean_dy_xmu  # dx = scale * (dy - mean_dy) + slope * xmu
            xmu = x - _c(mean, x)
            grad_x = torch.addcmul(_c(-scale * mean_dy, x), xmu, _c(slope, x)).addcmul_(dy, _c(scale, x))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _c(per_channel: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``per_channel`` shaped to broadcast over ``x``'s channel dimension."""
    return per_channel.view(1, -1, *([1] * (x.dim() - 2)))


class DataParallelBatchNorm:
    """``bn.forward`` while a data-parallel strategy owns ``bn``: in training, torch's SyncBatchNorm
    with its statistics over ``group`` (never torch's sync too, when torch.distributed is initialized);
    otherwise (or ``group`` None: a module unpickled) torch's own: running statistics, no communication."""

    __slots__ = ("bn", "eager", "group")

    def __init__(self, bn: nn.SyncBatchNorm, group: CommunicationBackend | None) -> None:
        self.bn = bn
        self.group = group
        self.eager: Callable[..., torch.Tensor] | None = None

    def _sync_batch_norm(self) -> Callable[..., torch.Tensor]:
        """The synchronized function; once ``torch.compile`` is loaded, run eagerly (a graph break: the
        collectives are not traced). Not before: ``disable()`` would load it (seconds)."""
        if "torch._dynamo" not in sys.modules:
            return _SyncBatchNorm.apply
        if self.eager is None:
            self.eager = torch.compiler.disable(_SyncBatchNorm.apply)
        return self.eager

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        if self.group is None or not bn.training:
            return nn.SyncBatchNorm.forward(bn, x)  # evaluation: no communication, as in torch
        bn._check_input_dim(x)  # noqa: SLF001 - torch's own check of its layer
        factor = 0.0 if bn.momentum is None else bn.momentum
        if bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else factor
        running = (bn.running_mean, bn.running_var) if bn.track_running_stats else (None, None)
        if self.group.world_size == 1:
            return F.batch_norm(x, *running, bn.weight, bn.bias, True, factor, bn.eps)
        return self._sync_batch_norm()(x, bn.weight, bn.bias, *running, bn.eps, factor, self.group)

    def __deepcopy__(self, memo: dict[int, Any]) -> DataParallelBatchNorm:
        """A copy of the module (an EMA model) syncs over the same group, which is not copied."""
        return DataParallelBatchNorm(copy.deepcopy(self.bn, memo), self.group)

    def __reduce__(self) -> tuple[type[DataParallelBatchNorm], tuple[nn.SyncBatchNorm, None]]:
        """Pickled (``torch.save(module)``) without the group: torch's own forward."""
        return (DataParallelBatchNorm, (self.bn, None))


def sync_batch_norms(module: nn.Module, who: str) -> list[nn.SyncBatchNorm]:
    """The ``nn.SyncBatchNorm`` layers of ``module``; refuses one dtlab cannot synchronize as asked."""
    found = []
    for name, m in module.named_modules():
        if not isinstance(m, nn.SyncBatchNorm):
            continue
        patched = m.__dict__.get("forward")
        if type(m).forward is not nn.SyncBatchNorm.forward or not (
            patched is None or isinstance(patched, DataParallelBatchNorm)
        ):
            raise StrategyError(
                f"{who}: the nn.SyncBatchNorm {name!r} has its own forward ({type(m).__name__}); {who} "
                "synchronizes SyncBatchNorm by running torch's forward with its statistics over the "
                "data-parallel group, which would replace yours. Use nn.SyncBatchNorm itself"
            )
        if m.process_group is not None:
            raise StrategyError(
                f"{who}: the nn.SyncBatchNorm {name!r} was given a process_group; {who} computes its "
                "statistics over the data-parallel group it was built on. Convert with "
                "nn.SyncBatchNorm.convert_sync_batchnorm(model) (process_group=None)"
            )
        found.append(m)
    return found


def refuse_sync_batch_norm(module: nn.Module, who: str, under: str) -> None:
    """Refuse ``nn.SyncBatchNorm`` in ``module`` under ``under`` (``"a pipeline"`` or ``"tp"``)."""
    names = [n for n, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if names:
        why = "each micro-batch's" if under == "a pipeline" else "those of activations tp may split"
        raise StrategyError(
            f"{who}: {names[:3]} {'is an' if len(names) == 1 else 'are'} nn.SyncBatchNorm, not synchronized "
            f"under {under}: its statistics would be {why}, not the batch's. dtlab synchronizes "
            "SyncBatchNorm under data parallelism alone (DDPModel, ZeRO1/2/3Model, FSDPModel, or this "
            "model with tp = pp = 1 and one micro-batch): use that, or nn.BatchNorm (per-rank statistics)"
        )
