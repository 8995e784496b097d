"""Old names still read, with a FutureWarning naming the new one: renamed fields (:data:`RENAMED`) and
``strategy.model``'s old spellings ``tensor``, ``pipeline`` and ``hybrid``."""

from __future__ import annotations

import warnings
from types import MappingProxyType
from typing import Any

from dtlab.core import pairs

#: (section, old field name) -> new name: the old names are still read, with a FutureWarning
RENAMED: MappingProxyType[tuple[str, str], str] = MappingProxyType(
    {
        ("strategy", "bucket_mb"): "bucket_cap_mb",
        ("compression", "warmup_steps"): "dense_warmup_steps",
        ("compression", "rank"): "powersgd_rank",
    }
)


def accept_old_names(section: str, values: Any) -> Any:
    """``values`` of ``section`` with each old field name of :data:`RENAMED` read as its new name."""
    if not isinstance(values, dict):
        return values
    out = dict(values)
    for (sec, old), new in RENAMED.items():
        if sec != section or old not in out:
            continue
        if new in out:
            raise ValueError(
                f"{section}.{old} is the old name of {section}.{new}; both are set: keep only {section}.{new}"
            )
        out[new] = out.pop(old)
        warnings.warn(
            f"{section}.{old} is deprecated: it is now {section}.{new} (the old name still works for now)",
            FutureWarning,
            stacklevel=2,
        )
    return out


def old_model_spelling(strategy: dict[str, Any], parallel: Any) -> dict[str, Any]:
    """``strategy.model`` tensor, pipeline or hybrid (the old spellings, when it also named the
    model-parallel class) as the data-parallel strategy they ran on the dp axis: the optimizer's
    (``ddp`` unless ``strategy.optimizer`` says otherwise), with a FutureWarning naming the new spelling.
    ``parallel``: the raw ``parallel`` section when known (tensor kept pp = 1, pipeline tp = 1)."""
    old = strategy.get("model")
    if not isinstance(old, str) or old.lower() not in pairs.MODEL_PARALLEL:
        return strategy
    old = old.lower()
    par = parallel if isinstance(parallel, dict) else {}
    other = {
        "tensor": ("pp", "dp x tp", "pipeline stages"),
        "pipeline": ("tp", "pp x dp", "tensor parallelism"),
    }
    if old in other:
        axis, mesh, what = other[old]
        size = par.get(axis, 1)
        if isinstance(size, int) and not isinstance(size, bool) and size > 1:
            raise ValueError(
                f"strategy.model={old!r} runs on the {mesh} mesh, but parallel.{axis}={size}; use "
                f"strategy.model=hybrid (or a data-parallel strategy such as ddp) for {what} too"
            )
    optimizer = strategy.get("optimizer")
    new = optimizer.lower() if isinstance(optimizer, str) else "ddp"
    new = new if new in pairs.DATA_PARALLEL else "ddp"
    warnings.warn(
        f"strategy.model={old!r} is deprecated: strategy.model names the data-parallel strategy over the "
        f"dp axis ({', '.join(pairs.DATA_PARALLEL)}) and the model-parallel layout follows from "
        f"parallel.tp / parallel.pp; write strategy.model={new} (the old spelling still works for now)",
        FutureWarning,
        stacklevel=2,
    )
    return {**strategy, "model": new}


def translate_old_spellings(tree: Any) -> Any:
    """A whole config tree with ``strategy.model``'s old spellings translated (see above)."""
    if not isinstance(tree, dict) or not isinstance(tree.get("strategy"), dict):
        return tree
    return {**tree, "strategy": old_model_spelling(tree["strategy"], tree.get("parallel"))}
