"""Affine value forms over the ball: the form and its invariant (form.py), its rules by kind
(elementwise, products, linear, norms, masks) and the walk over a graph (walk.py);
docs/local-affine.md.
"""
