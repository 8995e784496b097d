"""``Mesh``: named axes of process groups over one backend (``{"pp": 2, "dp": 2, "tp": 2}``).

Ranks are laid out row-major, the last axis fastest (tp innermost, as Megatron and torchtitan place
it): world rank = ``(pp_i * dp + dp_i) * tp + tp_i``. Every group is made at construction, one
:meth:`~dtlab.backends.base.CommunicationBackend.split` per combination of axes (a mesh of ``n``
axes makes ``2**n - 2`` splits: the combination of all axes is the backend itself), plus one for
this rank alone when no axis has size 1; never lazily, so no order of access can deadlock.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dtlab.backends.base import CommunicationBackend, check_backend
from dtlab.errors import ArgumentError, ArgumentTypeError, integer

__all__ = ["Axes", "Mesh", "MeshLike"]

Axes = str | tuple[str, ...]


@runtime_checkable
class MeshLike(Protocol):
    """What dtlab's model strategies use of a mesh; :class:`Mesh` is one, and a mesh object of your own
    with these members is accepted wherever a strategy takes a mesh.

    An axis the mesh lacks has size 1: ``size`` is 1, ``coordinate`` 0, ``mesh[axis]`` a group of this
    rank alone. Several axes (outermost first) are flattened row-major, the last fastest.
    """

    @property
    def backend(self) -> CommunicationBackend:
        """The backend over every rank of the mesh."""
        ...

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, outermost first."""
        ...

    @property
    def shape(self) -> Mapping[str, int]:
        """``{axis: size}``, outermost first."""
        ...

    def __contains__(self, axis: object) -> bool: ...

    def size(self, axes: Axes) -> int:
        """Ranks along ``axes`` (the product for several)."""
        ...

    def coordinate(self, axes: Axes) -> int:
        """This rank's coordinate along ``axes``: its ``rank`` in ``mesh[axes]``."""
        ...

    def ranks(self, axes: Axes) -> list[int]:
        """World ranks of this rank's group along ``axes``, in group-rank order."""
        ...

    def __getitem__(self, axes: Axes) -> CommunicationBackend:
        """This rank's group along ``axes``."""
        ...


def _ravel(coords: Sequence[int], sizes: Sequence[int]) -> int:
    index = 0
    for c, s in zip(coords, sizes, strict=True):
        index = index * s + c
    return index


def _unravel(index: int, sizes: Sequence[int]) -> list[int]:
    coords = [0] * len(sizes)
    for i in range(len(sizes) - 1, -1, -1):
        index, coords[i] = divmod(index, sizes[i])
    return coords


def _resolve(sizes: Mapping[str, int] | Iterable[tuple[str, int]], world_size: int) -> dict[str, int]:
    """Validated sizes with ``-1`` resolved; one error names every size, their product and the world."""
    try:
        if isinstance(sizes, str):
            raise TypeError
        pairs: list[tuple[str, int]] = (
            list(sizes.items()) if isinstance(sizes, Mapping) else [(n, s) for n, s in sizes]
        )
    except (TypeError, ValueError):  # not iterable, or its items are not (name, size) pairs
        raise ArgumentTypeError(
            f"Mesh: sizes must map axis names to sizes, e.g. {{'dp': -1, 'tp': 2}}, got {sizes!r}"
        ) from None
    shown = ", ".join(f"{n!r}: {s!r}" for n, s in pairs)

    def fail(problem: str) -> ArgumentError:
        return ArgumentError(f"Mesh({{{shown}}}) on a world of {world_size} ranks: {problem}")

    if not pairs:
        raise fail("give at least one axis, e.g. Mesh(backend, {'dp': -1})")
    names = [p[0] for p in pairs]
    bad_names = [n for n in names if not isinstance(n, str) or not n]
    if bad_names:
        raise fail(f"axis names must be non-empty strings, got {bad_names}")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise fail(f"axis names must be unique, {dupes} repeat")
    # NumPy's integers taken as torch takes them, stored as Python ints; a bool is no size
    given = [(n, integer(s)) for n, s in pairs]
    bad = [
        f"{n}={s!r}" for (n, s), (_, i) in zip(pairs, given, strict=True) if i is None or (i < 1 and i != -1)
    ]
    if bad:
        raise fail(f"sizes must be positive ints (one may be -1 for the rest of the world), got {bad}")
    pairs = [(n, i) for n, i in given if i is not None]
    values = [p[1] for p in pairs]
    rest = [n for n, s in pairs if s == -1]
    known = math.prod(s for s in values if s != -1)
    if len(rest) > 1:
        raise fail(f"only one axis may be -1, got {rest}")
    if rest:
        if world_size % known:
            raise fail(
                f"{rest[0]}=-1 needs the world size {world_size} to be a multiple of the product of "
                f"the other sizes, {known}"
            )
        return {n: (world_size // known if s == -1 else s) for n, s in pairs}
    if known != world_size:
        raise fail(
            f"the sizes' product {known} must equal the world size {world_size} (or use -1 for one axis)"
        )
    return dict(pairs)


class Mesh:
    """Named axes of process groups over ``backend``; collective: every rank of ``backend`` builds it.

    ``mesh["tp"]`` is this rank's group along tp (its ``rank`` is this rank's tp coordinate);
    ``mesh["dp", "tp"]`` the group over both axes flattened (row-major, last fastest). An axis the
    mesh lacks has size 1: ``mesh["cp"]`` is a group of this rank alone, ``coordinate("cp")`` is 0.
    Axes of a combination are named outermost first, as in the mesh.
    """

    def __init__(
        self, backend: CommunicationBackend, sizes: Mapping[str, int] | Iterable[tuple[str, int]]
    ) -> None:
        check_backend(backend, "Mesh")
        shape = _resolve(sizes, backend.world_size)
        self._backend = backend
        self._names = tuple(shape)
        self._shape = shape
        dims = list(shape.values())
        self._coords = dict(zip(self._names, _unravel(backend.rank, dims), strict=True))
        self._groups: dict[tuple[str, ...], CommunicationBackend] = {self._names: backend}
        self._made: list[CommunicationBackend] = []
        for n in range(1, len(self._names)):
            for combo in itertools.combinations(self._names, n):
                others = [a for a in self._names if a not in combo]
                color = _ravel([self._coords[a] for a in others], [shape[a] for a in others])
                key = _ravel([self._coords[a] for a in combo], [shape[a] for a in combo])
                self._groups[combo] = self._split(color, key)
        solo = next((g for g in self._groups.values() if g.world_size == 1), None)
        self._groups[()] = solo if solo is not None else self._split(backend.rank, 0)

    def _split(self, color: int, key: int) -> CommunicationBackend:
        group = self._backend.split(color, key)
        if group is None:  # pragma: no cover - a color was given, so the engine must return a group
            raise RuntimeError(f"{self._backend!r}.split({color}, {key}) returned no group")
        self._made.append(group)
        return group

    # ------------------------------------------------------------------ layout
    @property
    def backend(self) -> CommunicationBackend:
        """The backend the mesh was built on (its ranks are the mesh's world ranks)."""
        return self._backend

    @property
    def axis_names(self) -> tuple[str, ...]:
        """Axis names, outermost first."""
        return self._names

    @property
    def shape(self) -> dict[str, int]:
        """``{axis: size}`` outermost first, ``-1`` resolved (a copy)."""
        return dict(self._shape)

    @property
    def sizes(self) -> dict[str, int]:
        """Deprecated spelling of :attr:`shape`."""
        warnings.warn("Mesh.sizes is deprecated: use Mesh.shape", DeprecationWarning, stacklevel=2)
        return dict(self._shape)

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's coordinate on every axis."""
        return dict(self._coords)

    def __contains__(self, axis: object) -> bool:
        return axis in self._shape

    def size(self, axes: Axes) -> int:
        """Ranks along ``axes`` (the product for several); 1 for an axis the mesh lacks."""
        return math.prod(self._shape[a] for a in self._present(axes))

    def coordinate(self, axes: Axes) -> int:
        """This rank's coordinate along ``axes`` (several: flattened, row-major); 0 for absent axes.
        It is this rank's ``rank`` in ``mesh[axes]``."""
        present = self._present(axes)
        return _ravel([self._coords[a] for a in present], [self._shape[a] for a in present])

    def ranks(self, axes: Axes) -> list[int]:
        """World ranks of this rank's group along ``axes``, in group-rank order."""
        present = self._present(axes)
        sizes = [self._shape[a] for a in present]
        out = []
        for index in range(math.prod(sizes)):
            coords = dict(self._coords)
            coords.update(zip(present, _unravel(index, sizes), strict=True))
            out.append(self.rank_at(coords))
        return out

    def rank_at(self, coordinates: Mapping[str, int]) -> int:
        """The world rank at ``coordinates``; axes not given keep this rank's coordinate.
        ``mesh.rank_at({"pp": stage})``: the rank of that pipeline stage in this rank's dp/tp place."""
        unknown = [a for a in coordinates if a not in self._shape]
        if unknown:
            raise ArgumentError(f"Mesh.rank_at: axes {unknown} are not in this mesh's {list(self._names)}")
        coords = {**self._coords, **coordinates}
        at = [integer(coords[a]) for a in self._names]  # NumPy's integers taken; a bool refused
        out = [a for a, i in zip(self._names, at, strict=True) if i is None or not 0 <= i < self._shape[a]]
        if out:
            raise ArgumentError(
                f"Mesh.rank_at({dict(coordinates)}): {[f'{a}={coords[a]!r}' for a in out]} outside the "
                f"mesh's shape {self._shape}"
            )
        return _ravel([i for i in at if i is not None], list(self._shape.values()))

    # ------------------------------------------------------------------ groups
    def __getitem__(self, axes: Axes) -> CommunicationBackend:
        return self._groups[self._present(axes)]

    def _present(self, axes: Axes) -> tuple[str, ...]:
        """The mesh's axes among ``axes`` (absent ones have size 1 and drop out), checked for order."""
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        if not names or not all(isinstance(a, str) for a in names) or len(set(names)) != len(names):
            raise ArgumentError(f"mesh[{axes!r}]: name one or more distinct axes (strings), e.g. mesh['tp']")
        present = tuple(a for a in names if a in self._shape)
        ordered = tuple(a for a in self._names if a in present)
        if present != ordered:
            raise ArgumentError(f"mesh[{axes!r}]: name the axes outermost first, as in the mesh: {ordered!r}")
        return present

    def close(self) -> None:
        """Close the groups the mesh made (not :attr:`backend`); every rank calls it."""
        for group in self._made:
            group.close()
        self._made.clear()

    def __repr__(self) -> str:
        return f"Mesh({self._shape}, rank={self._backend.rank}, coordinates={self._coords})"


if TYPE_CHECKING:  # mypy checks that Mesh satisfies the protocol
    _mesh_is_mesh_like: type[MeshLike] = Mesh
