"""The tensor plan a model declares itself (``plan="auto"``): :func:`declared_plan`; its order and
what each source looks like: docs/your_model.md, "The tensor plan"."""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from dtlab.errors import StrategyError, check_switches
from dtlab.models.tensor._plan import DeclaredPlan, HeadsParallel, Plan, PlanDict, Style

__all__ = ["bart_plan", "bert_plan", "declared_plan", "gpt2_plan", "hugging_face_plan"]


def _check_prefix(who: str, prefix: object, example: str) -> None:
    """``prefix`` is the module path the plan's names start with: ``""`` or names ending in ``.``."""
    if not isinstance(prefix, str) or (prefix and not prefix.endswith(".")):
        raise StrategyError(
            f"{who}(prefix=...) is '' or a module path ending in '.', e.g. {example!r}; got {prefix!r}"
        )


def gpt2_plan(prefix: str = "transformer.", head: bool = True) -> PlanDict:
    """GPT-2 (``GPT2LMHeadModel``; ``prefix=""``, ``head=False`` for ``GPT2Model``): the token
    embedding vocabulary-parallel, each attention's fused ``c_attn`` split per head (q, k and v of the
    same heads on one rank; its ``split_size`` set to the local width), ``c_proj`` row-parallel, the MLP
    column- then row-parallel, and the head (tied to the embedding) column-parallel with its logits
    gathered. Hugging Face's GPT-2 declares no plan."""
    _check_prefix("gpt2_plan", prefix, "transformer.")
    check_switches("gpt2_plan", head=head)
    plan: dict[str, Style | str] = {
        f"{prefix}wte": "embedding_rowwise",
        f"{prefix}h.*.attn": HeadsParallel(qkv=("c_attn",), out="c_proj", heads="split_size", sections=3),
        f"{prefix}h.*.mlp.c_fc": "colwise",
        f"{prefix}h.*.mlp.c_proj": "rowwise",
    }
    if head:
        plan["lm_head"] = "colwise_gather_output"
    return plan


def bert_plan(prefix: str = "bert.") -> PlanDict:
    """BERT (``BertForMaskedLM`` and the other heads over ``bert``; ``prefix=""`` for ``BertModel``): each
    encoder layer's query, key and value column-parallel (whole heads per rank: its attention infers the
    head count), its attention output row-parallel, the intermediate column- then the output
    row-parallel. The embeddings, pooler and heads stay whole: the masked-LM head's decoder shares its
    bias with ``cls.predictions.bias``, a parameter of the head itself, which no split keeps tied.
    Hugging Face's BERT declares no plan."""
    _check_prefix("bert_plan", prefix, "bert.")
    layer = f"{prefix}encoder.layer.*."
    plan: dict[str, Style | str] = {
        f"{layer}attention.self.{p}": "colwise" for p in ("query", "key", "value")
    }
    plan.update({f"{layer}attention.output.dense": "rowwise", f"{layer}intermediate.dense": "colwise"})
    plan[f"{layer}output.dense"] = "rowwise"
    return plan


def bart_plan(prefix: str = "model.") -> PlanDict:
    """BART (``BartForConditionalGeneration``; ``prefix=""`` for ``BartModel``): in every encoder and
    decoder layer each attention's q, k and v column-parallel (its attention infers the head count), its
    ``out_proj`` row-parallel, ``fc1`` column- and ``fc2`` row-parallel. The shared embedding (tied to
    the encoder's, the decoder's and the head) and the head stay whole. BART declares no plan."""
    _check_prefix("bart_plan", prefix, "model.")
    plan: dict[str, Style | str] = {}
    for part, attentions in (("encoder", ("self_attn",)), ("decoder", ("self_attn", "encoder_attn"))):
        layer = f"{prefix}{part}.layers.*."
        for att in attentions:
            plan.update({f"{layer}{att}.{p}_proj": "colwise" for p in "qkv"})
            plan[f"{layer}{att}.out_proj"] = "rowwise"
        plan.update({f"{layer}fc1": "colwise", f"{layer}fc2": "rowwise"})
    return plan


def _recipe(module: nn.Module) -> PlanDict | None:
    model_type = getattr(getattr(module, "config", None), "model_type", None)
    if model_type in ("bert", "bart"):
        recipe, prefix = (bert_plan, "bert") if model_type == "bert" else (bart_plan, "model")
        return recipe(f"{prefix}." if isinstance(getattr(module, prefix, None), nn.Module) else "")
    if model_type == "gpt2":
        if isinstance(getattr(module, "transformer", None), nn.Module):
            return gpt2_plan("transformer.", isinstance(getattr(module, "lm_head", None), nn.Module))
        if isinstance(getattr(module, "wte", None), nn.Module):
            return gpt2_plan("", head=False)
    return None


def hugging_face_plan(module: nn.Module) -> PlanDict | None:
    """The plan a Hugging Face model declares (``None``: it declares none)."""
    for declared in (getattr(module, "tp_plan", None), getattr(module, "_tp_plan", None)):
        if isinstance(declared, Mapping) and declared:
            return dict(declared)
    base = getattr(getattr(module, "config", None), "base_model_tp_plan", None)
    if not isinstance(base, Mapping) or not base:
        return None
    prefix = getattr(module, "base_model_prefix", "")
    if isinstance(prefix, str) and prefix and isinstance(getattr(module, prefix, None), nn.Module):
        return {f"{prefix}.{k}": v for k, v in base.items()}
    return dict(base)


def declared_plan(module: nn.Module, plan: Plan) -> PlanDict:
    """``plan`` itself, or for ``"auto"`` / a :class:`DeclaredPlan` the one ``module`` declares: its
    ``tp_plan(sequence_parallel=...)`` method, else Hugging Face's (:func:`hugging_face_plan`), else
    dtlab's recipe for its architecture (GPT-2: :func:`gpt2_plan`, BERT: :func:`bert_plan`, BART:
    :func:`bart_plan`); anything else is refused, saying
    what to pass. The styles are checked by :func:`dtlab.models.tensor._plan.resolve_plan`."""
    if isinstance(plan, str):
        if plan != "auto":
            raise StrategyError(
                f"tensor plan {plan!r}: a plan is 'auto' (the model's own) or a mapping "
                "{'fqn-pattern': style}"
            )
        plan = DeclaredPlan()
    if not isinstance(plan, DeclaredPlan):
        return plan
    method = getattr(module, "tp_plan", None)
    if callable(method):
        own: PlanDict = method(sequence_parallel=plan.sequence_parallel)
        return own
    name = type(module).__name__
    if plan.sequence_parallel:
        raise StrategyError(
            f"sequence parallelism needs a plan that declares it (a tp_plan(sequence_parallel=True) "
            f"method); {name} has none: pass the plan by hand with SequenceParallel() on its norms"
        )
    found = hugging_face_plan(module) or _recipe(module)
    if found is None:
        linears = [n for n, m in module.named_modules() if isinstance(m, nn.Linear)]
        mine = f"; its nn.Linear layers: {linears[:8]}{' ...' if len(linears) > 8 else ''}" if linears else ""
        raise StrategyError(
            f"plan='auto': {name} declares no tensor plan (a tp_plan(sequence_parallel=False) method, or "
            "Hugging Face's _tp_plan / config.base_model_tp_plan); pass the plan itself (dtlab train: "
            "parallel.plan), a column-parallel layer feeding a row-parallel one, e.g. "
            f"{{'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}}{mine} (docs/your_model.md)"
        )
    return found
