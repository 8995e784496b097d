"""Compatibility path: the built-in models live in :mod:`dtlab.zoo`."""

from dtlab.zoo import Block, CausalSelfAttention, DigitsCNN, TransformerLM

__all__ = ["Block", "CausalSelfAttention", "DigitsCNN", "TransformerLM"]
