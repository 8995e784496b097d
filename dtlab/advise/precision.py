"""How wide each kind of value is: ``--precision fp32|bf16-mixed|fp16-mixed`` as ``dtlab train`` runs it.

``dtlab train``'s ``train.precision=bf16`` (or ``fp16``) keeps the parameters in fp32 (they are the
master weights the optimizer steps), computes under ``torch.autocast`` (the weights cast to bf16 on
use, the activations kept in bf16), accumulates fp32 gradients and sends them as computed (fp32;
``strategy.reduce_dtype`` narrows them). Other frameworks keep bf16 parameters beside an fp32 master
copy (Megatron-LM, DeepSpeed: 2 + 4 + 4 + 8 = 18 bytes per parameter with fp32 gradients): describe
them with :meth:`Precision.custom`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtlab.errors import ArgumentError, integer

__all__ = ["PRECISIONS", "Precision"]

#: the names ``--precision`` takes
PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of value a rank holds or sends.

    - ``params``: the parameters as stored (and as ZeRO-3/FSDP gather them);
    - ``compute``: the weights as the matrix products use them (``< params``: autocast's copies,
      held from the forward to the backward beside the parameters they were cast from);
    - ``grads``: gradients as accumulated; ``reduce``: as sent over the data-parallel axis;
    - ``master``: an fp32 copy beside narrower parameters (0: the parameters are the master);
    - ``states``: each optimizer state (Adam's two moments);
    - ``activations``: what autograd keeps and what the pipeline and tensor parallelism send.
    """

    name: str = "fp32"
    params: int = 4
    compute: int = 4
    grads: int = 4
    master: int = 0
    states: int = 4
    activations: int = 4
    reduce: int = 4

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name == "name":
                continue
            v = getattr(self, f.name)
            low, n = (0 if f.name == "master" else 1), integer(v)
            if n is None or n < low:
                raise ArgumentError(f"Precision.{f.name} must be an integer >= {low} (bytes), got {v!r}")
            object.__setattr__(self, f.name, n)

    @classmethod
    def named(cls, name: str) -> Precision:
        """``fp32``; ``bf16-mixed``/``fp16-mixed``: dtlab train's ``train.precision=bf16``/``fp16``
        (fp32 parameters, gradients and Adam states; 2-byte compute copies and activations)."""
        if name == "fp32":
            return cls()
        if name in ("bf16-mixed", "fp16-mixed"):
            return cls(name, params=4, compute=2, grads=4, master=0, states=4, activations=2, reduce=4)
        raise ArgumentError(f"unknown precision {name!r}; choose one of {', '.join(PRECISIONS)}")

    def custom(self, name: str | None = None, **widths: int) -> Precision:
        """This policy with some widths changed (and a new name), e.g. Megatron-LM's bf16:
        ``Precision.named("bf16-mixed").custom("megatron-bf16", params=2, compute=2, master=4)``."""
        unknown = sorted(set(widths) - {f.name for f in dataclasses.fields(self)} - {"name"})
        if unknown:
            raise ArgumentError(f"Precision has no width {unknown}; widths: params, compute, grads, "
                                "master, states, activations, reduce")  # fmt: skip
        return dataclasses.replace(self, name=name or f"{self.name}*", **widths)

    def state_bytes(self, states_per_element: int) -> int:
        """Optimizer bytes per parameter element: its states and the master copy."""
        return states_per_element * self.states + self.master
