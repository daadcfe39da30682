"""The Jacobian enclosure's op rules: one local rule class per op family in a registry, the
enclosure arithmetic they share, LayerNorm's Jacobian and the elementwise ranges
(docs/local-enclosure.md).
"""
