"""``seeded_init(seed)`` draws from generators of its own, never from torch's global RNG: another
thread drawing at the same time (an in-memory rank building outside the block, ``torch.randn``) cannot
change the block's numbers, and the block leaves the global RNG's state as it was. A random op the
block cannot give its own generator is refused, naming it.

These tests draw from the global RNG on purpose (that is the disturbance), each inside
``torch.random.fork_rng`` so the global state after the test is the one before it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dtlab.backends.base import CommunicationBackend
from dtlab.core import seeded_init
from dtlab.errors import StrategyError
from dtlab.testing import run_world


@pytest.fixture(autouse=True)
def _global_rng_kept() -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        yield


def _build(inside: threading.Event, drawn: threading.Event) -> dict[str, torch.Tensor]:
    """A model built under seeded_init(3) in two halves: between them it says it is inside the block
    and waits until another thread has drawn from the global RNG."""
    with seeded_init(3):
        first = nn.Linear(16, 32)
        inside.set()
        assert drawn.wait(30)
        rest = nn.Sequential(nn.Linear(32, 8), nn.LayerNorm(8), nn.Embedding(10, 8))
        noise = torch.randn(6)
    return {**nn.Sequential(first, rest).state_dict(), "noise": noise}


def _build_into(got: list[dict[str, torch.Tensor]], inside: threading.Event, drawn: threading.Event) -> None:
    got.append(_build(inside, drawn))


def _undisturbed() -> dict[str, torch.Tensor]:
    done = threading.Event()
    done.set()
    return _build(done, done)


def _disturb() -> torch.Tensor:
    """What a rank does outside seeded_init: draws from torch's global RNG (a layer, a batch)."""
    nn.Linear(64, 64)
    return torch.randn(100)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_a_draw_of_another_thread_inside_the_block_changes_nothing_in_20_builds() -> None:
    want = _undisturbed()
    for _ in range(20):
        inside, drawn = threading.Event(), threading.Event()
        got: list[dict[str, torch.Tensor]] = []
        builder = threading.Thread(target=_build_into, args=(got, inside, drawn))
        builder.start()
        assert inside.wait(30)
        _disturb()  # while the builder is inside its block
        drawn.set()
        builder.join(30)
        assert len(got) == 1 and _same(got[0], want) == []


def test_a_tight_loop_of_global_draws_beside_20_builds_changes_nothing() -> None:
    want = _undisturbed()
    stop = threading.Event()

    def draw_until_stopped() -> None:
        while not stop.is_set():
            _disturb()

    drawer = threading.Thread(target=draw_until_stopped)
    drawer.start()
    try:
        got = [_undisturbed() for _ in range(20)]
    finally:
        stop.set()
        drawer.join(30)
    assert [_same(g, want) for g in got] == [[]] * 20


def test_an_in_memory_rank_building_outside_the_block_leaves_the_others_build_alone() -> None:
    """The in-memory backend: rank 1 builds its layers outside seeded_init while rank 0 is inside."""
    want = _undisturbed()
    inside, drawn = threading.Event(), threading.Event()

    def rank(backend: CommunicationBackend) -> dict[str, torch.Tensor]:
        if backend.rank == 0:
            return _build(inside, drawn)
        assert inside.wait(30)
        _disturb()
        drawn.set()
        return {}

    got = run_world(2, rank, timeout=60)
    assert _same(got[0], want) == []


def test_the_block_leaves_the_global_rng_as_it_was_and_a_draw_outside_gets_its_own_numbers() -> None:
    before = torch.get_rng_state()
    with seeded_init(0):
        nn.Linear(8, 8)
        torch.randn(10)
    assert torch.equal(torch.get_rng_state(), before)
    plain = torch.randn(5)  # what a thread outside gets, drawn here without any block
    after = torch.get_rng_state()
    torch.set_rng_state(before)
    inside, outside = threading.Event(), threading.Event()
    got: list[torch.Tensor] = []

    def draw_while_inside() -> None:
        assert inside.wait(30)
        got.append(torch.randn(5))
        outside.set()

    drawer = threading.Thread(target=draw_while_inside)
    drawer.start()
    with seeded_init(0):
        nn.Linear(8, 8)
        inside.set()
        assert outside.wait(30)
        nn.Linear(8, 8)
    drawer.join(30)
    assert torch.equal(got[0], plain)  # not the block's seeded numbers
    assert torch.equal(torch.get_rng_state(), after)


def test_a_reseed_inside_the_block_does_not_outlive_it() -> None:
    """A model factory's own torch.manual_seed: the global RNG after the block is the one before it (a
    process that seeded each rank's dropout stream before the build keeps it), the block's numbers as
    without the reseed."""
    torch.manual_seed(11)
    before = torch.get_rng_state()
    with seeded_init(0):
        torch.manual_seed(5)
        built = nn.Linear(8, 8).weight
    assert torch.equal(torch.get_rng_state(), before)
    with seeded_init(0):
        assert torch.equal(nn.Linear(8, 8).weight, built)


def test_the_blocks_numbers_are_a_fresh_generators_and_nest() -> None:
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    want = [
        torch.randn(4, generator=g1),
        torch.randint(0, 9, (4,), generator=g2),
        torch.rand(3, generator=g1),
    ]
    mine = torch.Generator().manual_seed(9)
    with seeded_init(1):
        a = torch.randn(4)
        with seeded_init(2):
            b = torch.randint(0, 9, (4,))
        with torch.device("meta"):
            nn.Linear(100, 100)  # the meta device draws nothing
        explicit = torch.rand(2, generator=mine)  # a generator given is used as given
        c = torch.rand(3)
    assert all(torch.equal(x, y) for x, y in zip([a, b, c], want, strict=True))
    assert torch.equal(explicit, torch.rand(2, generator=torch.Generator().manual_seed(9)))


def test_a_random_op_taking_no_generator_is_refused_naming_it() -> None:
    x = torch.ones(8)
    with seeded_init(0), pytest.raises(StrategyError, match=r"aten\.native_dropout\.default draws random"):
        torch.native_dropout(x, 0.5, True)
    keep = torch.empty(8).bernoulli_(0.5, generator=torch.Generator().manual_seed(0))
    with seeded_init(0):
        assert torch.equal(torch.native_dropout(x, 0.5, False)[0], x)  # drawing nothing: allowed
        assert torch.equal(nn.functional.dropout(x, 0.5), x * keep / 0.5)  # on the CPU: the block's


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the block's generator per GPU")
def test_a_gpu_draws_from_the_blocks_generator_of_that_gpu() -> None:
    with torch.random.fork_rng(devices=list(range(torch.cuda.device_count()))):
        before = torch.cuda.get_rng_state_all()
        gen = torch.Generator(device="cuda").manual_seed(4)  # as torch.cuda.manual_seed_all(4) seeds it
        want = [
            torch.randn(8, device="cuda", generator=gen),
            torch.empty(8, device="cuda").normal_(generator=gen),
        ]
        with seeded_init(4):
            got = [torch.randn(8, device="cuda"), torch.empty(8, device="cuda").normal_()]
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))
        assert all(torch.equal(x, y) for x, y in zip(torch.cuda.get_rng_state_all(), before, strict=True))


@pytest.mark.skipif(
    not hasattr(torch.ops.aten.rand_like, "generator"),
    reason="this torch's rand*_like take no generator to compare",
)
def test_rand_like_draws_as_torchs_own_overload_taking_a_generator() -> None:
    """Where torch's ``rand*_like`` take no generator (before torch 2.10) the block runs them as their
    kernel does, an ``empty_like`` filled in place: the same numbers, layout and dtype as the overload
    that takes one."""
    from dtlab.core.random_ops import draw_like  # here: a name only this module has

    aten = torch.ops.aten
    t = torch.empty(4, 6).t()  # not contiguous: the layout is kept
    cases = [
        (aten.rand_like.default, aten.rand_like.generator, (t,), {"dtype": torch.float64}),
        (aten.randn_like.default, aten.randn_like.generator, (t,), {}),
        (aten.randint_like.default, aten.randint_like.generator, (t, 7), {}),
        (
            aten.randint_like.low_dtype,
            aten.randint_like.low_generator_dtype,
            (t, 3, 9),
            {"dtype": torch.int64},
        ),
    ]
    for like, overload, args, kwargs in cases:
        got = draw_like(like, args, kwargs, torch.Generator().manual_seed(5))
        want = overload(*args, **kwargs, generator=torch.Generator().manual_seed(5))
        assert (got.dtype, got.stride()) == (want.dtype, want.stride()) and torch.equal(got, want), like


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_draw_inside_activation_checkpointing_is_refused(reentrant: bool) -> None:
    """torch.utils.checkpoint recomputes its forward in backward from the global RNG's state, which the
    block does not draw from: the recomputed dropout mask would differ from the forward's."""
    with seeded_init(1):
        net = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
        x = torch.ones(4, 8, requires_grad=True)
        with pytest.raises(
            StrategyError, match=r"aten\.bernoulli_\.float draws random numbers inside torch\.utils"
        ):
            checkpoint(net, x, use_reentrant=reentrant)
        checkpoint(net.eval(), x, use_reentrant=reentrant).sum().backward()  # drawing nothing: allowed


@pytest.mark.parametrize("seed", ["0", 1.5, None, True, 2**70])
def test_a_seed_torch_cannot_take_is_named(seed: object) -> None:
    # torch's own messages did not name the call: "manual_seed expected a long, but got str", "Overflow"
    with pytest.raises(ValueError if seed == 2**70 else TypeError, match=r"^seeded_init\(seed\): seed must"):
        with seeded_init(seed):  # type: ignore[arg-type]
            pass


def test_a_numpy_integer_seed_draws_as_the_int() -> None:
    # torch.manual_seed(np.int64(3)) takes it; seeded_init stopped with torch.Generator's raw "an integer
    # is required"
    np = pytest.importorskip("numpy")
    draws = []
    for seed in (3, np.int64(3), np.uint32(3)):
        with seeded_init(seed):
            draws.append(nn.Linear(4, 4).weight.detach().clone())
    assert all(torch.equal(d, draws[0]) for d in draws)
