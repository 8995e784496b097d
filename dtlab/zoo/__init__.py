"""dtlab's built-in models (plain ``nn.Module``s): the transformer language model and the digits CNN
the embedded tasks train. Each declares how it is split the way a user's model does: its tensor plan
(``tp_plan()``) and its pipeline blocks (``pipeline_blocks()``)."""

from dtlab.zoo.builtin import Block, CausalSelfAttention, DigitsCNN, TransformerLM

__all__ = ["Block", "CausalSelfAttention", "DigitsCNN", "TransformerLM"]
