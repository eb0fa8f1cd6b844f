"""Rank layout: how global ranks map to (tp, cp, dp, pp) coordinates and process groups, and the
size checks every layout goes through (``require_positive``, ``check_sizes``).

Pure arithmetic, no processes. The ``order`` string names the dimensions from the innermost
(consecutive ranks) to the outermost, as Megatron writes it. With the default ``"tp-cp-dp-pp"``
a rank is ``tp + tp_size * (cp + cp_size * (dp + dp_size * pp))``: tensor-parallel groups are
consecutive ranks (inside a node, on NVLink), context parallelism next, pipeline stages are the
outermost cut. An order of the three others alone (``"tp-dp-pp"``) puts cp right after tp.
"""
from __future__ import annotations

from dataclasses import InitVar, dataclass
from functools import cached_property
from itertools import product
from typing import NamedTuple

DIMS = ("tp", "cp", "dp", "pp")


def require_positive(values: dict, where: str = "", flags: bool = False,
                     error: type[ValueError] = ValueError) -> None:
    """Raise ``error`` naming the first of ``values`` (name -> value) that is not an integer
    >= 1; ``flags`` names it as a command-line flag (``--micro-batch-size``)."""
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            shown = "--" + name.replace("_", "-") if flags else name
            kind = "" if isinstance(v, int) and not isinstance(v, bool) else "an integer "
            raise error(f"{where}{shown}={v!r} must be {kind}>= 1")


def check_sizes(world: int, tp: int, pp: int, dp: int | None,
                world_name: str = "world_size=", cp: int = 1) -> int:
    """dp (``None``: ``world // (tp * cp * pp)``) once tp * cp * pp * dp is checked to be
    ``world``."""
    names = "tp*pp" if cp == 1 else "tp*cp*pp"
    sizes = f"{tp}*{pp}" if cp == 1 else f"{tp}*{cp}*{pp}"
    if dp is None:
        if world % (tp * cp * pp):
            raise ValueError(f"{world_name}{world} is not divisible by {names} = {sizes} = "
                             f"{tp * cp * pp}")
        dp = world // (tp * cp * pp)
    if tp * cp * pp * dp != world:
        raise ValueError(f"{names}*dp = {sizes}*{dp} = {tp * cp * pp * dp} != "
                         f"{world_name}{world}")
    return dp


class Coords(NamedTuple):
    """Where one rank sits in the layout."""

    dp: int
    pp: int
    tp: int
    cp: int = 0


def _parse_order(order: str) -> tuple[str, ...]:
    dims = tuple(d.strip() for d in order.split("-")) if isinstance(order, str) else ()
    if sorted(dims) == sorted(d for d in DIMS if d != "cp"):      # cp right after tp
        dims = tuple(x for d in dims for x in ((d, "cp") if d == "tp" else (d,)))
    if sorted(dims) != sorted(DIMS):
        raise ValueError(f"order={order!r} must be a '-'-separated permutation of tp, cp, dp, "
                         f"pp (innermost first; cp may be left out), e.g. 'tp-cp-dp-pp'")
    return dims


@dataclass(frozen=True)
class Layout:
    """ranks -> (dp, pp, tp, cp): the one object that sizes and checks a layout.

    ``dp=None`` means ``world_size // (tp * cp * pp)``. Construction raises ``ValueError`` naming
    the numbers when a size is < 1, the sizes do not multiply to ``world_size`` (called
    ``world_name`` in the message), or ``order`` is not a permutation; launch, the trainer,
    :func:`fastpar.init` and the checkpoint all read the one it makes."""

    world_size: int
    tp: int = 1
    pp: int = 1
    dp: int | None = None
    order: str = "tp-cp-dp-pp"
    cp: int = 1
    world_name: InitVar[str] = "world_size="

    def __post_init__(self, world_name: str):
        require_positive({k: getattr(self, k) for k in ("world_size", "tp", "pp", "dp", "cp")
                          if k != "dp" or self.dp is not None})
        object.__setattr__(self, "dp", check_sizes(self.world_size, self.tp, self.pp, self.dp,
                                                   world_name, cp=self.cp))
        _parse_order(self.order)

    def sizes(self) -> dict[str, int]:
        """``{"tp": .., "pp": .., "dp": .., "cp": ..}``, as a checkpoint's manifest records it."""
        return {d: self.size(d) for d in ("tp", "pp", "dp", "cp")}

    @cached_property
    def _dims(self) -> tuple[str, ...]:
        return _parse_order(self.order)

    def size(self, dim: str) -> int:
        return getattr(self, dim)

    def _stride(self, dim: str) -> int:
        stride = 1
        for d in self._dims:
            if d == dim:
                return stride
            stride *= self.size(d)
        raise ValueError(f"unknown dimension {dim!r}")

    def coords(self, rank: int) -> Coords:
        """The (dp, pp, tp, cp) coordinates of a global rank."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank={rank} out of range for world_size={self.world_size}")
        c = {d: (rank // self._stride(d)) % self.size(d) for d in DIMS}
        return Coords(dp=c["dp"], pp=c["pp"], tp=c["tp"], cp=c["cp"])

    def rank(self, dp: int = 0, pp: int = 0, tp: int = 0, cp: int = 0) -> int:
        """The global rank at the given coordinates (the inverse of :meth:`coords`)."""
        c = {"dp": dp, "pp": pp, "tp": tp, "cp": cp}
        for d, v in c.items():
            if not 0 <= v < self.size(d):
                raise ValueError(f"{d}={v} out of range for {d} size {self.size(d)}")
        return sum(c[d] * self._stride(d) for d in DIMS)

    def groups(self, dim: str) -> list[list[int]]:
        """Every group along ``dim`` (or along several, ``"dp-cp"``): ranks that share the
        other coordinates, sorted."""
        along = dim.split("-")
        others = [d for d in DIMS if d not in along]
        out = []
        for fixed in product(*(range(self.size(d)) for d in others)):
            base = dict(zip(others, fixed))
            out.append(sorted(self.rank(**base, **dict(zip(along, idx)))
                              for idx in product(*(range(self.size(d)) for d in along))))
        return sorted(out)

    @cached_property
    def tp_groups(self) -> list[list[int]]:
        return self.groups("tp")

    @cached_property
    def pp_groups(self) -> list[list[int]]:
        return self.groups("pp")

    @cached_property
    def dp_groups(self) -> list[list[int]]:
        return self.groups("dp")

    @cached_property
    def cp_groups(self) -> list[list[int]]:
        return self.groups("cp")

    def group_of(self, dim: str, rank: int) -> list[int]:
        """The ``dim`` group that holds ``rank`` (``"dp-cp"``: dp outer, cp inner)."""
        c = self.coords(rank)._asdict()
        along = dim.split("-")
        return [self.rank(**{**c, **dict(zip(along, idx))})
                for idx in product(*(range(self.size(d)) for d in along))]


def layout(world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
           order: str = "tp-cp-dp-pp", cp: int = 1) -> Layout:
    """``Layout(world_size, tp, pp, dp, order, cp)``: lay ``world_size`` ranks out into tensor-,
    context-, pipeline- and data-parallel groups (see :class:`Layout`)."""
    return Layout(world_size, tp, pp, dp, order, cp)
