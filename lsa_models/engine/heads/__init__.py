"""Margins through the model's head: a final LayerNorm deferred past a linear head, a ReLU head
relaxed per margin (docs/local-affine.md).
"""
