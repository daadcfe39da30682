"""Derived graphs: the model's tangent graph (the inf-ball's constant) and adjoint graph (margin
gradients over the ball), and the dual norms of the gradient's form (docs/local-graphs.md).
"""
