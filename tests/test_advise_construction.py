"""``dtlab advise`` predicts construction's peak host memory as ``dtlab train`` builds the model:
``meta`` (the share of parameters plus the largest module of the real ``TransformerLM``, made whole
one at a time) where the plan shards the model, ``plain`` (the whole model) where it does not."""

from __future__ import annotations

from dtlab.advise import Candidate, ClusterSpec, ModelSpec, predict
from dtlab.trainers.construction import largest_module_bytes
from dtlab.trainers.models import TransformerLM


def test_the_build_column_is_the_share_plus_the_largest_module_or_the_whole_model() -> None:
    spec, cluster = ModelSpec.builtin(), ClusterSpec(ranks=8)
    net = TransformerLM(vocab=spec.vocab, d_model=spec.hidden, n_layers=spec.layers, n_heads=spec.heads,
                        seq_len=spec.seq_len)  # fmt: skip
    whole = sum(p.numel() for p in net.parameters()) * 4
    assert whole == spec.parameters * 4
    largest = largest_module_bytes(net)  # the real module's, float32
    for cand, init in [
        (Candidate("zero3", dp=8), "meta"),
        (Candidate("fsdp", dp=8), "meta"),
        (Candidate("ddp", dp=4, tp=2), "meta"),
        (Candidate("zero2", dp=4, pp=2, schedule="1f1b", micro_batches=2), "meta"),
        (Candidate("ddp", dp=8), "plain"),
        (Candidate("zero1", dp=8), "plain"),
    ]:
        p = predict(spec, cluster, cand, 32)
        assert p.fits and not p.problems, (cand, p.problems)
        assert p.init == init, cand
        if init == "plain":
            assert p.construction == whole, cand
        else:
            share = max(m.parameters for m in p.stage_memory)
            assert p.construction == share + largest, cand
            assert p.construction < whole, cand
