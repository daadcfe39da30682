"""Graph rewrites that keep the function and give the recogniser the ops it reads.

Two-operand Einsums that are batched matrix products (x-transformers writes attention as
`b h i d, b h j d -> b h i j` and `b h i j, b h j d -> b h i d`) become MatMul (with a
Transpose of the second operand for the `...ik,...jk` form): the same sums of products in
the same order, so nothing the analysis reads changes. The rewrite acts on the analyser's node
list only; onnxruntime still checks the uploaded graph.
"""

from __future__ import annotations

from .ops import Node


def _batched_matmul(eq: str) -> bool | None:
    """For `...ik,...kj->...ij` False, for `...ik,...jk->...ij` True (transpose the second
    operand), otherwise None."""
    eq = eq.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    a, b = terms
    r = len(out)
    if r < 2 or len(a) != r or len(b) != r or len(set(a)) != r or len(set(b)) != r \
            or len(set(out)) != r:
        return None
    if a[:-2] != out[:-2] or b[:-2] != out[:-2] or a[-2] != out[-2]:
        return None
    i, k, j = a[-2], a[-1], out[-1]
    if len({i, k, j}) != 3:
        return None
    if b[-2:] == k + j:
        return False
    if b[-2:] == j + k:
        return True
    return None


def lower_einsum(nodes: list[Node]) -> list[Node]:
    """The node list with batched-matmul Einsums replaced by MatMul (and a Transpose)."""
    out: list[Node] = []
    for nd in nodes:
        if nd.op_type != "Einsum" or len(nd.inputs) != 2:
            out.append(nd)
            continue
        eq = nd.attrs.get("equation", b"")
        eq = eq.decode() if isinstance(eq, bytes) else str(eq)
        kind = _batched_matmul(eq)
        if kind is None:
            out.append(nd)
            continue
        a, b = nd.inputs
        if kind:
            r = len(eq.split("->")[1].replace(" ", ""))
            perm = [*range(r - 2), r - 1, r - 2]
            bt = f"{nd.outputs[0]}__einsum_bt"
            out.append(Node(f"{nd.name}/Transpose", "Transpose", [b], [bt], {"perm": perm},
                            nd.domain))
            b = bt
        out.append(Node(nd.name, "MatMul", [a, b], list(nd.outputs), {}, nd.domain))
    return out
