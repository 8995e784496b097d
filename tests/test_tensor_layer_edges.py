"""Tensor-parallel layers at the edges the parity runs do not reach: a Hugging Face ``Conv1D`` split
row-wise (its weight stored ``[in, out]``), one all-reduce for the input gradient of layers reading the
same tensor, an embedding resized after the split, an uneven sequence under sequence parallelism, a
view by the whole head count with the sequence length inferred, and a plan entry summing the gradients of
a module's submodules over tp."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from filled import filled
from test_tensor_same_grads import FIX, LR, _batch, _net, _one_process, _plan, _steps
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import RowParallelLinear, TensorParallelModel, VocabParallelEmbedding
from dtlab.models.tensor._comm import reduce_scatter_to_seq
from dtlab.models.tensor._plan import apply_plan, resolve_plan
from dtlab.optimizers import DDPOptimizer
from dtlab.testing import run_world


def _conv1d_world(backend: CommunicationBackend) -> tuple[float, float]:
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    p, r = backend.world_size, backend.rank
    plain = filled(conv1d(6, 8), 0)  # nf=6 outputs, nx=8 inputs: weight [8, 6]
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    want = plain(x)
    want.square().sum().backward()
    row = RowParallelLinear.from_linear(plain, backend)  # takes this rank's 8/p input features
    got = row(x.chunk(p, -1)[r])
    got.square().sum().backward()
    weight_grad = plain.weight.grad.chunk(p, 0)[r]  # type: ignore[union-attr]
    return float((got - want).abs().max()), float((row.weight.grad - weight_grad).abs().max())  # type: ignore[operator]


def test_a_row_parallel_conv1d_takes_its_split_input_and_matches_the_plain_layer() -> None:
    for rank, (out, grad) in enumerate(run_world(2, _conv1d_world)):
        assert out < 1e-5 and grad < 1e-5, f"rank {rank}: output error {out}, weight gradient error {grad}"


class _Gated(nn.Module):
    """A norm's output read by two column-parallel layers (an MLP's gate and up projections)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.gate, self.up = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        filled(self, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.down(F.silu(self.gate(h)) * self.up(h))


def _gated_world(backend: CommunicationBackend) -> tuple[int, float]:
    model = _Gated()  # the plan applied alone: no data-parallel strategy and its checks around it
    plan = {"gate": "colwise", "up": "colwise", "down": "rowwise"}
    apply_plan(model, resolve_plan(model, plan, 2), backend)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(4))
    out = model(x)
    before = backend.stats["all_reduce"].calls
    out.square().sum().backward()
    ref = _Gated()
    ref(x).square().sum().backward()
    got, want = model.norm.weight.grad, ref.norm.weight.grad
    err = float((got - want).abs().max() / want.abs().max())  # type: ignore[operator, union-attr]
    return backend.stats["all_reduce"].calls - before, err


def test_layers_reading_one_tensor_all_reduce_its_input_gradient_once() -> None:
    """Megatron's f: the gate's and up's input gradients are summed locally, then all-reduced once."""
    for rank, (calls, err) in enumerate(run_world(2, _gated_world)):
        assert err < 1e-6, f"rank {rank}: the norm's weight gradient is off by {err} (relative)"
        assert calls == 1, f"rank {rank}: {calls} all-reduces in backward, want 1 (the shared input's)"


def _resized_embedding(backend: CommunicationBackend) -> None:
    emb = VocabParallelEmbedding.from_embedding(filled(nn.Embedding(8, 4), 0), backend)
    emb.weight.data = torch.zeros(6, 4)  # as resize_token_embeddings on the wrapped model does
    emb(torch.tensor([[1, 7]]))


def test_an_embedding_resized_after_the_split_is_refused_naming_the_fix() -> None:
    with pytest.raises(RankFailedError, match=r"not this rank's shard \(4, 4\).*resize the plain model"):
        run_world(2, _resized_embedding)


def test_an_uneven_sequence_into_a_sequence_parallel_reduce_scatter_is_named() -> None:
    def uneven(backend: CommunicationBackend) -> None:
        reduce_scatter_to_seq(torch.ones(2, 3, 4), backend)

    with pytest.raises(RankFailedError, match=r"sequence \(dim 1\) is 3.*sequence length divisible by 2"):
        run_world(2, uneven)


class _InferredSequence(nn.Module):
    """An attention viewing q by the whole head count and head_dim, the sequence length inferred (-1)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = filled(nn.Linear(16, 16), 5), filled(nn.Linear(16, 16), 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(x.shape[0], -1, 4, 4)  # 4 heads of 4: a whole width of 16
        return self.o(q.flatten(2))


def test_a_view_by_the_whole_head_count_with_the_length_inferred_is_named() -> None:
    """torch's 'shape [2, -1, 4, 4] is invalid for input of size 80' (tp=2, an odd length of 5)."""

    def run(backend: CommunicationBackend) -> None:
        model = TensorParallelModel(_InferredSequence(), backend, plan={"q": "colwise", "o": "rowwise"})
        model(torch.ones(2, 5, 16))

    with pytest.raises(RankFailedError, match=r"invalid for input of size 80\. At tp=2 .*HeadsParallel"):
        run_world(2, run)


def _nested_world(backend: CommunicationBackend) -> tuple[str, dict[str, torch.Tensor] | None]:
    net = _net()
    for block in net:  # the per-head scale one module down: the entry marks the module around it
        block.scale = nn.Sequential(block.scale)
    model = TensorParallelModel(net, backend, plan=_plan((0, 1)))
    x, y = _batch()
    trained = _steps(model, DDPOptimizer(model, torch.optim.SGD, lr=LR), x, y)
    return trained, model.full_state_dict() if trained == "trained" else None


def test_a_module_marked_replicated_with_grad_allreduce_sums_its_submodules_gradients() -> None:
    """The entry covers the parameters of the module and of every module inside it, as torch's
    SequenceParallel distributes ``module.named_parameters()``."""
    want = {k.replace(".scale.", ".scale.0."): v for k, v in _one_process().items()}
    for rank, (trained, state) in enumerate(run_world(2, _nested_world)):
        assert trained == "trained" and state is not None, f"rank {rank}: {trained}"
        err = max(float((state[k] - v).abs().max() / v.abs().max()) for k, v in want.items())
        assert err < 1e-10, f"rank {rank}: {err} relative error against one process"


class _ScalarScaled(nn.Module):
    """A one-element parameter used on the split activations: each tp rank computes its share."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = filled(nn.Linear(8, 16), 7), filled(nn.Linear(16, 8), 8)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x) * self.scale)


def _scalar_world(backend: CommunicationBackend) -> str:
    model = TensorParallelModel(_ScalarScaled(), backend, plan={"up": "colwise", "down": "rowwise"})
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(9))
    try:
        model(x).square().sum().backward()
    except StrategyError as exc:
        return str(exc)
    return "accepted"


def test_a_one_element_parameter_with_a_partial_gradient_is_refused() -> None:
    for rank, said in enumerate(run_world(2, _scalar_world)):
        assert "'scale'" in said and FIX in said, f"rank {rank}: {said}"
