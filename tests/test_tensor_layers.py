"""Each tensor-parallel layer against the plain layer it replaces: output, input gradient and this rank's
shard of the weight gradient (Megatron's and picotron's layer tests), the vocabulary-parallel
cross-entropy against ``F.cross_entropy``, and the sequence-parallel collectives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from filled import filled
from torch import nn

from dtlab.backends.base import CommunicationBackend
from dtlab.core.placement import Replicate, Shard, placement_of
from dtlab.errors import RankFailedError, StrategyError
from dtlab.models import (
    ColumnParallelLinear,
    RowParallelLinear,
    RowwiseParallel,
    TensorParallelModel,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from dtlab.models.tensor._comm import gather_from_sequence, reduce_scatter_to_seq
from dtlab.testing import run_world


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def layers_world(backend: CommunicationBackend, sequence_parallel: bool) -> dict[str, float]:
    p, r = backend.world_size, backend.rank
    fc1, fc2 = filled(nn.Linear(8, 24), 0), filled(nn.Linear(24, 8), 1)
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(2), requires_grad=True)
    ref = fc2(F.gelu(fc1(x)))
    ref.square().sum().backward()
    col = ColumnParallelLinear.from_linear(fc1, backend, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_linear(fc2, backend, sequence_parallel=sequence_parallel)
    xin = x.detach().chunk(p, 1)[r] if sequence_parallel else x.detach()
    xin = xin.clone().requires_grad_()
    out = row(F.gelu(col(xin)))
    out.square().sum().backward()
    want_out = ref.chunk(p, 1)[r] if sequence_parallel else ref
    want_gx = x.grad.chunk(p, 1)[r] if sequence_parallel else x.grad  # type: ignore[union-attr]
    bias_grad = row.bias.grad  # type: ignore[union-attr]
    if sequence_parallel:  # the model all-reduces these partial sums after backward
        backend.all_reduce(bias_grad)  # type: ignore[arg-type]
    errs = {
        "output": _err(out, want_out.detach()),
        "input grad": _err(xin.grad, want_gx),  # type: ignore[arg-type]
        "col weight grad": _err(col.weight.grad, fc1.weight.grad.chunk(p, 0)[r]),  # type: ignore[arg-type, union-attr]
        "col bias grad": _err(col.bias.grad, fc1.bias.grad.chunk(p, 0)[r]),  # type: ignore[arg-type, union-attr]
        "row weight grad": _err(row.weight.grad, fc2.weight.grad.chunk(p, 1)[r]),  # type: ignore[arg-type, union-attr]
        "row bias grad": _err(bias_grad, fc2.bias.grad),  # type: ignore[arg-type]
    }
    # gather_output and a whole input into the row-parallel layer
    col_g = ColumnParallelLinear.from_linear(fc1, backend, gather_output=True)
    row_w = RowParallelLinear.from_linear(fc2, backend, input_is_parallel=False)
    errs["gathered"] = _err(row_w(F.gelu(col_g(x.detach()))), ref.detach())
    # fused qkv: rank r holds part r of each of the three sections
    qkv = filled(nn.Linear(8, 24), 3)
    fused = ColumnParallelLinear.from_linear(qkv, backend, sections=3)
    want = qkv(x.detach()).view(2, 4, 3, p, -1)[:, :, :, r].reshape(2, 4, -1)
    errs["fused sections"] = _err(fused(x.detach()), want)
    assert placement_of(col.weight) == Shard("tp", 0) and placement_of(row.weight) == Shard("tp", 1)
    assert placement_of(row.bias) == Replicate() and placement_of(fused.weight) == Shard("tp", 0, 3)  # type: ignore[arg-type]
    return errs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_linear_layers_match_nn_linear(world: int, sequence_parallel: bool) -> None:
    for rank, errs in enumerate(run_world(world, layers_world, sequence_parallel)):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"tp={world} sp={sequence_parallel} rank {rank}: {bad}"


def embedding_and_loss_world(backend: CommunicationBackend, padding_idx: int | None) -> dict[str, float]:
    p, r = backend.world_size, backend.rank
    gen = torch.Generator().manual_seed(5)
    emb = filled(nn.Embedding(16, 6, padding_idx=padding_idx), 4)
    ids = torch.randint(0, 16, (3, 4), generator=gen)
    if padding_idx is not None:  # the padding row is looked up and gets no gradient, as nn.Embedding's
        ids[0, :2] = padding_idx
    ref = emb(ids)
    ref.square().sum().backward()
    par = VocabParallelEmbedding.from_embedding(emb, backend)
    out = par(ids)
    out.square().sum().backward()
    logits = torch.randn(3, 4, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 16, (3, 4), generator=gen)
    targets[0, 1] = -100
    want = F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))
    want.backward()
    mine = logits.detach().chunk(p, -1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, targets, backend)
    loss.backward()
    return {
        "embedding": _err(out, ref.detach()),
        "embedding grad": _err(par.weight.grad, emb.weight.grad.chunk(p, 0)[r]),  # type: ignore[arg-type, union-attr]
        "loss": abs(loss.item() - want.item()) / want.item(),
        "logit grad": _err(mine.grad, logits.grad.chunk(p, -1)[r]),  # type: ignore[arg-type, union-attr]
    }


@pytest.mark.parametrize("padding_idx", [None, 9])
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_embedding_and_cross_entropy(world: int, padding_idx: int | None) -> None:
    for rank, errs in enumerate(run_world(world, embedding_and_loss_world, padding_idx)):
        bad = {k: v for k, v in errs.items() if v > 1e-5}
        assert not bad, f"tp={world} rank {rank}: {bad}"


def sequence_world(backend: CommunicationBackend) -> tuple[float, float]:
    p, r = backend.world_size, backend.rank
    full = torch.arange(2 * 4 * 3, dtype=torch.float32).view(2, 4, 3)
    mine = full.chunk(p, 1)[r].clone().requires_grad_()
    gathered = gather_from_sequence(mine, backend)
    (gathered * (r + 1)).sum().backward()  # grad of a gather = the reduce-scatter of the ranks' grads
    total = sum(range(1, p + 1))
    rs = reduce_scatter_to_seq(full.clone(), backend)
    grad = mine.grad
    assert grad is not None
    return _err(gathered, full) + _err(grad, torch.full_like(mine, total)), _err(rs, p * full.chunk(p, 1)[r])


def test_sequence_collectives() -> None:
    for a, b in run_world(2, sequence_world):
        assert a == 0.0 and b == 0.0


def test_layer_errors() -> None:
    with pytest.raises(RankFailedError) as info:
        run_world(3, lambda b: VocabParallelEmbedding.from_embedding(nn.Embedding(256, 4), b))
    assert isinstance(info.value.__cause__, StrategyError)
    assert "256" in str(info.value) and "tp=3" in str(info.value)

    def bad_targets(b: CommunicationBackend) -> None:
        vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.tensor([0, 9]), b)

    with pytest.raises(RankFailedError, match=r"\[0, 9\].*vocabulary is 8"):
        run_world(2, bad_targets)


def _buffer_bias_linear() -> nn.Linear:
    """An nn.Linear whose bias is a buffer (a fixed offset, not trained) instead of a parameter."""
    linear = nn.Linear(4, 4)
    bias = linear.bias.detach().clone()
    del linear.bias
    linear.register_buffer("bias", bias)
    return linear


def test_a_buffer_or_plain_tensor_in_place_of_a_parameter_is_refused() -> None:
    """Only parameters are split (as torch's parallelize_module); the error names the attribute and the
    fix instead of torch's bare AttributeError."""

    def column(b: CommunicationBackend) -> None:
        ColumnParallelLinear.from_linear(_buffer_bias_linear(), b)

    with pytest.raises(RankFailedError, match=r"'bias' is a buffer \(Linear\).*make it an nn.Parameter"):
        run_world(2, column)

    def row(b: CommunicationBackend) -> None:
        RowParallelLinear.from_linear(_buffer_bias_linear(), b)

    with pytest.raises(RankFailedError, match=r"RowParallelLinear.*'bias' is a buffer") as info:
        run_world(2, row)
    assert isinstance(info.value.__cause__, StrategyError)

    def embedding(b: CommunicationBackend) -> None:
        emb = nn.Embedding(8, 4)
        table = emb.weight.detach().clone()
        del emb.weight
        emb.weight = table  # type: ignore[assignment]
        VocabParallelEmbedding.from_embedding(emb, b)

    with pytest.raises(RankFailedError, match=r"'weight' is a plain tensor attribute.*tensor-parallel plan"):
        run_world(2, embedding)


def _mlp() -> nn.Sequential:
    g = torch.Generator().manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return net


def _row_alone(backend: CommunicationBackend, style: object) -> torch.Tensor:
    model = TensorParallelModel(_mlp(), backend, plan={"2": style})
    return model(torch.linspace(-1, 1, 24).reshape(3, 8)).detach()


def test_a_row_parallel_layer_fed_a_whole_input_is_refused_naming_the_fixes() -> None:
    """A plan with a rowwise layer alone (nothing colwise before it) fed it the whole activations: a raw
    shape error from F.linear (as under torch's RowwiseParallel); now the layer names the two fixes, and
    the second, RowwiseParallel(input_is_parallel=False), equals the plain layer."""
    with pytest.raises(RankFailedError, match=r"input whose last dim is 8, not this rank's 4 .*'colwise'"):
        run_world(2, _row_alone, "rowwise")
    want = _mlp()(torch.linspace(-1, 1, 24).reshape(3, 8))
    out = run_world(2, _row_alone, RowwiseParallel(input_is_parallel=False))
    assert all(torch.allclose(o, want, atol=1e-5) for o in out)


class _FixedHeads(nn.Module):
    """An attention reshaping by the whole model's head count (the usual hand-written one), or by this
    rank's shape (``per_rank``: -1 for the heads and the output width, a fixed head_dim)."""

    def __init__(self, per_rank: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.per_rank = 4, 4, per_rank
        g = torch.Generator().manual_seed(1)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        heads, width = (-1, -1) if self.per_rank else (self.heads, d)
        q, k, v = (f(x).view(b, t, heads, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, t, width))


def _heads_world(backend: CommunicationBackend, per_rank: bool) -> torch.Tensor:
    plan = {"q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise"}
    model = TensorParallelModel(_FixedHeads(per_rank), backend, plan=plan)
    return model(torch.linspace(-1, 1, 160).reshape(2, 5, 16)).detach()


def test_an_attention_reshaping_by_the_whole_head_count_is_named_with_the_fix() -> None:
    """torch's raw view error ('shape [2, 5, 4, 4] is invalid for input of size 80') is re-raised
    naming the per-rank shapes and HeadsParallel; the forward reshaping with -1 equals one process."""
    with pytest.raises(RankFailedError, match=r"is invalid for input of size 80\. At tp=2 .*HeadsParallel"):
        run_world(2, _heads_world, False)
    want = _FixedHeads(True)(torch.linspace(-1, 1, 160).reshape(2, 5, 16))
    assert all(torch.allclose(o, want, atol=1e-5) for o in run_world(2, _heads_world, True))


class _OwnReshape(nn.Module):
    """A split MLP after a reshape of the whole input that fails at any tp (a user's own bug)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.mlp, self.shape = _mlp(), shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x.view(*self.shape).reshape(3, 8))


def _own_reshape(backend: CommunicationBackend, shape: tuple[int, ...]) -> torch.Tensor:
    model = TensorParallelModel(_OwnReshape(shape), backend, plan={"mlp.0": "colwise", "mlp.2": "rowwise"})
    return model(torch.linspace(-1, 1, 24).reshape(3, 8)).detach()


@pytest.mark.parametrize("shape", [(3, 9), (3, 5, -1)])
def test_a_reshape_that_fails_for_another_reason_keeps_torchs_error(shape: tuple[int, ...]) -> None:
    """Only a shape that tp times the input would fill is named as a whole head count or width; a
    reshape of the whole input that fails at any tp stays torch's RuntimeError (was: re-raised as the
    head-count StrategyError, 'At tp=2 ... column-split projections')."""
    with pytest.raises(
        RankFailedError, match=r"failed: RuntimeError: shape .* is invalid for input of size 24"
    ):
        run_world(2, _own_reshape, shape)
