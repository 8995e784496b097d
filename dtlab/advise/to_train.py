"""A plan ``dtlab advise`` ranks, written as the ``dtlab train`` settings that run it."""

from __future__ import annotations

from dtlab.advise.predict import Prediction
from dtlab.advise.spec import BYTE_VOCAB, ModelSpec

__all__ = ["train_settings"]

#: ``--precision`` -> ``train.precision``
_PRECISION = {"fp32": "fp32", "bf16-mixed": "bf16", "fp16-mixed": "fp16"}


def train_settings(pred: Prediction, spec: ModelSpec, global_batch: int, precision: str) -> list[str]:
    """``KEY=VALUE`` settings of ``dtlab train`` for the plan of ``pred`` (only those that differ from
    dtlab train's defaults); empty when dtlab does not run the plan today (``pred.runnable``). The
    model settings are the built-in transformer's; a model of another vocabulary or with tied
    embeddings is not the built-in one, and only the mesh, strategy and batch settings apply to it."""
    if not pred.runnable:
        return []
    c = pred.candidate
    builtin = ModelSpec.builtin()
    out = [f"backend.world_size={c.dp * c.tp * c.pp}", f"strategy.model={c.strategy}"]
    if spec.vocab == BYTE_VOCAB and not spec.tied_embeddings:
        for key, mine, default in (
            ("model.n_layers", spec.layers, builtin.layers),
            ("model.d_model", spec.hidden, builtin.hidden),
            ("model.n_heads", spec.heads, builtin.heads),
            ("model.seq_len", spec.seq_len, builtin.seq_len),
        ):
            out += [f"{key}={mine}"] if mine != default else []
    out += [f"parallel.tp={c.tp}"] if c.tp > 1 else []
    if c.pp > 1:
        out += [f"parallel.pp={c.pp}", f"parallel.schedule={c.schedule}"]
        out += [f"parallel.micro_batches={c.micro_batches}"] if c.micro_batches != c.pp else []
        out += [f"parallel.stages_per_rank={c.stages_per_rank}"] if c.stages_per_rank > 1 else []
    elif c.micro_batches > 1:
        out.append(f"data.accumulation_steps={c.micro_batches}")
    out += [f"data.global_batch_size={global_batch}"] if global_batch != 32 else []
    out += [f"train.precision={_PRECISION[precision]}"] if precision != "fp32" else []
    out += ["strategy.activation_checkpointing=true"] if c.checkpointing != "none" else []
    return out
