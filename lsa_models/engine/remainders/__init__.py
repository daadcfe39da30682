"""Remainders of the Jacobian enclosure: the telescoped sum of each op's remainder term and its
factored, signed, operator-norm and second-order forms (docs/local-second-order.md).
"""
