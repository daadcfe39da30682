"""Graph rewrites that keep the function and give the recogniser the ops it reads.

Two-operand Einsums that are batched matrix products (x-transformers writes attention as
`b h i d, b h j d -> b h i j` and `b h i j, b h j d -> b h i d`) become MatMul (with a
Transpose of the second operand for the `...ik,...jk` form): the same sums of products in
the same order, so nothing the analysis reads changes. Einsums of three or more operands are
contracted pairwise from the right (the paper's `bnd,hdf,hfe->bhne`: the two weights first,
a constant), and a product with more than one free index per operand (`bnd,hde->bhne`, heads
by einsum) becomes Transpose, Unsqueeze and a broadcast MatMul. The rewrite acts on the
analyser's node list only; onnxruntime still checks the uploaded graph.
"""

from __future__ import annotations

import numpy as np
import onnx

from .ops import Node


def _two_operands(eq: str) -> tuple[str, str, str] | None:
    """(a, b, out) of an explicit two-operand equation `a,b->out` (no ellipsis), else None."""
    eq = eq.replace(" ", "")
    if "..." in eq or "->" not in eq:
        return None
    lhs, out = eq.split("->")
    terms = lhs.split(",")
    if len(terms) != 2:
        return None
    return terms[0], terms[1], out


def _batched_matmul(eq: str) -> bool | None:
    """For `...ik,...kj->...ij` False, for `...ik,...jk->...ij` True (transpose the second
    operand), otherwise None."""
    parsed = _two_operands(eq)
    if parsed is None:
        return None
    a, b, out = parsed
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


def _permuted_matmul(eq: str) -> tuple[list[int], list[int], list[int]] | None:
    """For a two-operand Einsum that is a batched matrix product up to axis permutations
    (neural_stpp writes `tbhd,sbhd->tsbh` and `tsbh,sbhm->tbhm`): one index free in each
    operand, one contracted, every other index in both operands and the output. Returns the
    Transpose perms of a (to `batch, i, k`), b (to `batch, k, j`) and of the product
    (`batch, i, j` to the output's order), else None."""
    parsed = _two_operands(eq)
    if parsed is None:
        return None
    a, b, out = parsed
    if any(len(set(t)) != len(t) for t in (a, b, out)):
        return None
    a_free = [c for c in a if c not in b]
    b_free = [c for c in b if c not in a]
    contr = [c for c in a if c in b and c not in out]
    batch = [c for c in out if c in a and c in b]
    if len(a_free) != 1 or len(b_free) != 1 or len(contr) != 1 or \
            sorted(out) != sorted(batch + a_free + b_free) or \
            set(a) != set(batch + a_free + contr) or set(b) != set(batch + b_free + contr):
        return None
    i, j, k = a_free[0], b_free[0], contr[0]
    prod = [*batch, i, j]
    return ([a.index(c) for c in (*batch, i, k)], [b.index(c) for c in (*batch, k, j)],
            [prod.index(c) for c in out])


def _transpose(name: str, src: str, dst: str, perm: list[int], like: Node) -> Node:
    return Node(name, "Transpose", [src], [dst], {"perm": perm}, like.domain)


def _split_einsum(nd: Node) -> list[Node]:
    """An Einsum of three or more operands as two-operand Einsums, the last two operands
    first (exact in real arithmetic: a sum over the same products; each intermediate keeps
    the indices a later operand or the output reads)."""
    eq = nd.attrs.get("equation", b"")
    eq = (eq.decode() if isinstance(eq, bytes) else str(eq)).replace(" ", "")
    if "..." in eq or "->" not in eq or len(nd.inputs) < 3:
        return [nd]
    lhs, out = eq.split("->")
    terms, names = lhs.split(","), list(nd.inputs)
    if len(terms) != len(names):
        return [nd]
    nodes: list[Node] = []
    k = 0
    while len(terms) > 2:
        a, b = terms[-2], terms[-1]
        rest = "".join(terms[:-2]) + out
        mid = "".join(c for c in dict.fromkeys(a + b) if c in rest)
        t = f"{nd.outputs[0]}__einsum_pair{k}"
        nodes.append(Node(f"{nd.name}/Einsum_pair{k}", "Einsum", names[-2:], [t],
                          {"equation": f"{a},{b}->{mid}".encode()}, nd.domain))
        terms, names = [*terms[:-2], mid], [*names[:-2], t]
        k += 1
    nodes.append(Node(nd.name, "Einsum", names, list(nd.outputs),
                      {"equation": f"{terms[0]},{terms[1]}->{out}".encode()}, nd.domain))
    return nodes


def _broadcast_matmul(eq: str, a_dims: tuple[int | str, ...] | None = None
                      ) -> tuple[list[int], list[int], list[int], list[int], list[int]] | None:
    """For a two-operand Einsum that sums over one index and keeps every other (each at most
    once per operand): Transpose perms of a and b to `(their broadcast indices, i, k)` and
    `(..., k, j)`, the axes Unsqueeze inserts in each for the other's free indices, and the
    perm of the product `(broadcast indices, i, j)` to the output's order. `j` is b's free
    index that comes last in the output; `i` is a's largest free axis by `a_dims` (the
    tokens, not a batch of one: the recogniser reads rows of the product), the last in the
    output among equals. None otherwise."""
    parsed = _two_operands(eq)
    if parsed is None:
        return None
    a, b, out = parsed
    if any(len(set(t)) != len(t) for t in (a, b, out)) or not set(out) <= set(a + b):
        return None
    contr = [c for c in a if c in b and c not in out]
    if len(contr) != 1 or set(a + b) != set(out) | set(contr):
        return None
    k = contr[0]
    a_free = [c for c in out if c in a and c not in b]
    b_free = [c for c in out if c in b and c not in a]
    if not a_free or not b_free:
        return None
    def size(c: str) -> int:
        d = a_dims[a.index(c)] if a_dims is not None and len(a_dims) == len(a) else 0
        return d if isinstance(d, int) else 0

    i, j = max(reversed(a_free), key=size), b_free[-1]
    rest = [c for c in out if c not in (i, j)]  # broadcast indices, in the output's order
    pa = [a.index(c) for c in rest if c in a] + [a.index(i), a.index(k)]
    pb = [b.index(c) for c in rest if c in b] + [b.index(k), b.index(j)]
    ua = [n for n, c in enumerate(rest) if c not in a]
    ub = [n for n, c in enumerate(rest) if c not in b]
    prod = [*rest, i, j]
    return pa, ua, pb, ub, [prod.index(c) for c in out]


def _lower_broadcast(nd: Node, plan: tuple[list[int], list[int], list[int], list[int],
                                           list[int]], model: onnx.ModelProto) -> list[Node]:
    """Transpose, Unsqueeze (axes as an initializer) and a broadcast MatMul, then the
    product's Transpose: each output entry the same dot product over the summed index."""
    pa, ua, pb, ub, po = plan
    out: list[Node] = []
    ins = []
    for tag, name, perm, axes in (("a", nd.inputs[0], pa, ua), ("b", nd.inputs[1], pb, ub)):
        if perm != list(range(len(perm))):
            t = f"{nd.outputs[0]}__einsum_{tag}"
            out.append(_transpose(f"{nd.name}/Transpose_{tag}", name, t, perm, nd))
            name = t
        if axes:
            const = f"{nd.outputs[0]}__einsum_{tag}_axes"
            model.graph.initializer.append(
                onnx.numpy_helper.from_array(np.array(axes, dtype=np.int64), const))
            t = f"{nd.outputs[0]}__einsum_{tag}_wide"
            out.append(Node(f"{nd.name}/Unsqueeze_{tag}", "Unsqueeze", [name, const], [t], {},
                            nd.domain))
            name = t
        ins.append(name)
    if po == list(range(len(po))):
        out.append(Node(nd.name, "MatMul", ins, list(nd.outputs), {}, nd.domain))
        return out
    prod = f"{nd.outputs[0]}__einsum_ab"
    out.append(Node(nd.name, "MatMul", ins, [prod], {}, nd.domain))
    out.append(_transpose(f"{nd.name}/Transpose_out", prod, nd.outputs[0], po, nd))
    return out


def _dims(model: onnx.ModelProto) -> dict[str, tuple[int | str, ...]]:
    """Each tensor's shape from shape inference (`value_info`): sizes, or the symbol of a
    dynamic axis (two axes with the same symbol have the same size)."""
    out: dict[str, tuple[int | str, ...]] = {}
    for vi in [*model.graph.value_info, *model.graph.input, *model.graph.output]:
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        out[vi.name] = tuple(d.dim_value if d.HasField("dim_value") else
                             (d.dim_param or f"?{vi.name}:{k}") for k, d in enumerate(t.shape.dim))
    return out


def _softmax_perm(shape: tuple[int | str, ...], axis: int) -> list[int] | None:
    """The permutation putting the query axis (the other axis of the softmax axis' size,
    nearest before it) second to last and the softmax (key) axis last; None when the
    softmax is already over the last axis or no such axis exists."""
    r = len(shape)
    axis %= max(r, 1)
    if r < 2 or axis == r - 1:
        return None
    same = [k for k in range(r) if k != axis and shape[k] == shape[axis]]
    if not same:
        return None
    before = [k for k in same if k < axis]
    q = before[-1] if before else same[0]
    return [*[k for k in range(r) if k not in (q, axis)], q, axis]


def _cancel_transposes(nodes: list[Node], keep: set[str]) -> list[Node]:
    """`Transpose(Transpose(t, p1), p2)` with a single reader of the middle tensor becomes one
    Transpose with perm `p1[p2[i]]`, an Identity when that is the identity."""
    readers: dict[str, int] = {}
    for nd in nodes:
        for i in nd.inputs:
            readers[i] = readers.get(i, 0) + 1
    by_out = {o: nd for nd in nodes for o in nd.outputs}
    merged: set[str] = set()
    out: list[Node] = []
    for nd in nodes:
        first = by_out.get(nd.inputs[0]) if nd.op_type == "Transpose" and nd.inputs else None
        if first is None or first.op_type != "Transpose" or readers.get(nd.inputs[0]) != 1 \
                or nd.inputs[0] in keep or "perm" not in first.attrs or "perm" not in nd.attrs:
            out.append(nd)
            continue
        p1, p2 = list(first.attrs["perm"]), list(nd.attrs["perm"])
        perm = [p1[k] for k in p2]
        merged.add(first.name)
        if perm == list(range(len(perm))):
            out.append(Node(nd.name, "Identity", [first.inputs[0]], list(nd.outputs), {},
                            nd.domain))
        else:
            out.append(_transpose(nd.name, first.inputs[0], nd.outputs[0], perm, nd))
    return [nd for nd in out if nd.name not in merged]


def canonical_layouts(nodes: list[Node], model: onnx.ModelProto) -> list[Node]:
    """The node list in the layout the recogniser reads, the function unchanged: batched-
    matmul Einsums as MatMul (`lower_einsum`), permuted ones as Transpose + MatMul +
    Transpose, and a Softmax over an axis other than the last (sequence-first logits
    `(T, S, B, H)` over S) as Transpose + Softmax over the last axis + the inverse Transpose,
    with the query axis second to last; then back-to-back Transposes merged (the inverse
    Transpose and the value product's Transpose of P cancel)."""
    dims = _dims(model)
    out: list[Node] = []
    split = [p for nd in nodes for p in (_split_einsum(nd) if nd.op_type == "Einsum" else [nd])]
    for nd in lower_einsum(split):
        if nd.op_type == "Einsum" and len(nd.inputs) == 2:
            eq = nd.attrs.get("equation", b"")
            eq = eq.decode() if isinstance(eq, bytes) else str(eq)
            perms = _permuted_matmul(eq)
            if perms is not None:  # one free index each: the broadcast product, no Unsqueeze
                pa, pb, po = perms
                out.extend(_lower_broadcast(nd, (pa, [], pb, [], po), model))
                continue
            plan = _broadcast_matmul(eq, dims.get(nd.inputs[0]))
            if plan is not None:
                out.extend(_lower_broadcast(nd, plan, model))
                continue
        shape = dims.get(nd.inputs[0]) if nd.op_type == "Softmax" and nd.inputs else None
        perm = None if shape is None else _softmax_perm(shape, int(nd.attrs.get("axis", -1)))
        if perm is None:
            out.append(nd)
            continue
        inv = [perm.index(k) for k in range(len(perm))]
        t_in, t_out = f"{nd.outputs[0]}__keys_last_in", f"{nd.outputs[0]}__keys_last"
        out += [_transpose(f"{nd.name}/Transpose_in", nd.inputs[0], t_in, perm, nd),
                Node(nd.name, "Softmax", [t_in], [t_out], {**nd.attrs, "axis": -1}, nd.domain),
                _transpose(f"{nd.name}/Transpose_out", t_out, nd.outputs[0], inv, nd)]
    return _cancel_transposes(out, {o.name for o in model.graph.output})
