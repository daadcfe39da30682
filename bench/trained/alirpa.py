"""auto_LiRPA's side of bench/trained/compare_alirpa.py; runs ONLY in the separate auto_LiRPA
venv (bench/out/alirpa/venv: a benchmark baseline, never a dependency of lsa):

    bench/out/alirpa/venv/bin/python bench/trained/alirpa.py SPEC.json OUT.json

SPEC.json: {"name": a key of bench/trained/models.py's MODELS, "weights": its safetensors,
"images": a .npy of the images (K, 1, 8, 8), "labels": a .npy of their labels (K,),
"radii": {"inf": [...], "2": [...]}, "methods": ["CROWN", "alpha-CROWN"], "bisect": true,
"cap_seconds": per bound computation, "model_seconds": for the whole model,
"memory_gb": the address-space cap, "bound_opts": auto_LiRPA's bound options}.

Rebuilds the torch model from models.py and its weights (the same module the ONNX file was
exported from), wraps it once in a BoundedModule and, per image and norm (the ball is the
whole ball around the image, not clipped to [0, 1]: the set lsa certifies):
  - at each radius of the grid, ascending, whether each method verifies it (every margin
    f_label - f_j has a positive lower bound on the ball, one C matrix of the 9 margins);
    alpha-CROWN is not run where CROWN verified (its bound starts from CROWN's and keeps the
    best, so it verifies there too: recorded as "verified (CROWN)"), and a method is not run
    at radii above one it did not verify (recorded "not verified", "inferred");
  - CROWN's certified radius (before the other methods run): a geometric bisection between
    the grid's largest verified and smallest unverified radii (halving below the grid,
    doubling above it) to a ratio of 1 + the spec's bisect_tol;
  - seconds of each call; an error, a time cap ("cap") or an allocation failure ("oom")
    recorded as such (never counted as verified); after an OOM or a cap a method is not
    tried again at larger radii of that image and norm (it would not be cheaper there), and
    each norm gets an equal share of the model's time (images in order until it is spent;
    a call that would pass it is "skipped").
Writes one JSON object to OUT.json (rewritten after each image: a killed run keeps what it
measured).
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.trained.models import CLASSES, MODELS  # noqa: E402

BISECT_TOL = 0.1  # the bisection stops once hi / lo <= 1 + BISECT_TOL (spec: bisect_tol)
BISECT_CALLS = 16  # at most this many CROWN calls per bisection
HALVINGS = 6  # below the grid: at most this many halvings of its smallest radius


class Cap(Exception):
    """One bound computation ran past its time cap."""


def _alarm(_signum: int, _frame: Any) -> None:
    raise Cap


def _error(exc: BaseException) -> dict[str, Any]:
    full = f"{type(exc).__name__}: {exc}"
    oom = isinstance(exc, MemoryError) or "can't allocate memory" in full \
        or "not enough memory" in full or "DefaultCPUAllocator" in full
    return {"outcome": "oom" if oom else "error", "message": full[:300]}


def _explicit_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                   is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """scaled_dot_product_attention written out (MatMul, Softmax, MatMul): auto_LiRPA has no
    bound for the fused operator that torch's MultiheadAttention (need_weights=False) and
    x-transformers call; the same function, as a user of auto_LiRPA would rewrite it."""
    if attn_mask is not None or dropout_p or is_causal or enable_gqa:
        raise NotImplementedError("explicit attention: masks, dropout and GQA not needed here")
    s = q.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(q.matmul(k.transpose(-2, -1)) * s, dim=-1).matmul(v)


class ExplicitMHA(torch.nn.Module):
    """torch's nn.MultiheadAttention (batch_first, self-attention, no masks) with the same
    weights, written as three Linear maps, MatMul, Softmax, MatMul: the packed projection of
    torch's functional form unsqueezes the batch axis, which auto_LiRPA refuses to bound."""

    def __init__(self, mha: torch.nn.MultiheadAttention) -> None:
        super().__init__()
        assert mha.batch_first and mha._qkv_same_embed_dim and mha.in_proj_bias is not None
        d = mha.embed_dim
        self.batch_first, self.h, self.dh = True, mha.num_heads, d // mha.num_heads
        self.q, self.k, self.v = (torch.nn.Linear(d, d) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(mha.in_proj_weight[i * d:(i + 1) * d])
                lin.bias.copy_(mha.in_proj_bias[i * d:(i + 1) * d])
        self.out_proj = mha.out_proj

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_mask: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, **_: Any
                ) -> tuple[torch.Tensor, None]:
        assert attn_mask is None and key_padding_mask is None
        b, n, d = query.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, N, D) -> (B, H, N, dh)
            return t.reshape(b, n, self.h, self.dh).transpose(1, 2)

        q, k, v = heads(self.q(query)), heads(self.k(key)), heads(self.v(value))
        o = _explicit_sdpa(q, k, v).transpose(1, 2).reshape(b, n, d)
        return self.out_proj(o), None


class ExplicitTimmAttention(torch.nn.Module):
    """timm's Attention (no QK norm, no gate, no mask) with the same weights, its packed qkv
    split into three Linear maps: timm's permute and unbind move the batch axis, which
    auto_LiRPA refuses to bound."""

    def __init__(self, att: Any) -> None:
        super().__init__()
        assert isinstance(att.q_norm, torch.nn.Identity) and att.gate is None
        d, a = int(att.qkv.in_features), int(att.attn_dim)
        self.h: int = int(att.num_heads)
        self.dh: int = int(att.head_dim)
        self.a: int = a
        self.q, self.k, self.v = (torch.nn.Linear(d, a) for _ in range(3))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(att.qkv.weight[i * a:(i + 1) * a])
                lin.bias.copy_(att.qkv.bias[i * a:(i + 1) * a])
        self.norm: torch.nn.Module = att.norm
        self.proj: torch.nn.Module = att.proj

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                is_causal: bool = False) -> torch.Tensor:
        assert attn_mask is None and not is_causal
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:  # (B, N, A) -> (B, H, N, dh)
            return t.reshape(b, n, self.h, self.dh).transpose(1, 2)

        o = _explicit_sdpa(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)))
        return self.proj(self.norm(o.transpose(1, 2).reshape(b, n, self.a)))


def _explicit_attention(model: torch.nn.Module) -> None:
    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.MultiheadAttention):
                setattr(mod, child_name, ExplicitMHA(child))
            elif type(child).__name__ == "Attention" and hasattr(child, "qkv"):  # timm's
                setattr(mod, child_name, ExplicitTimmAttention(child))


def _einsum2(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A two-operand einsum (no repeated index within an operand) as Transpose, Reshape and
    one MatMul: A (batch, free_a, contracted) @ B (batch, contracted, free_b), the result
    permuted to the output's order; leading axes keep their place where they can, as
    auto_LiRPA bounds no op that moves the batch axis."""
    ins, out = eq.split("->")
    ia, ib = ins.split(",")
    assert len(set(ia)) == len(ia) and len(set(ib)) == len(ib), eq
    for idx, other in ((ia, ib), (ib, ia)):  # an index summed away in one operand alone
        lone = [c for c in idx if c not in other and c not in out]
        assert not lone, f"{eq}: index {lone} summed in one operand"
    batch = [c for c in ia if c in ib and c in out]
    contr = [c for c in ia if c in ib and c not in out]
    fa = [c for c in ia if c not in ib]
    fb = [c for c in ib if c not in ia]
    sa = dict(zip(ia, a.shape, strict=True))
    sb = dict(zip(ib, b.shape, strict=True))
    pa = [ia.index(c) for c in batch + fa + contr]
    pb = [ib.index(c) for c in batch + contr + fb]
    at = a.permute(*pa) if pa != sorted(pa) else a
    bt = b.permute(*pb) if pb != sorted(pb) else b
    k = math.prod(sa[c] for c in contr)
    at = at.reshape(*[sa[c] for c in batch + fa], k)
    nb = math.prod(sb[c] for c in fb)
    # B broadcast over A's free axes but the last
    bt = bt.reshape(*[sb[c] for c in batch], *([1] * max(len(fa) - 1, 0)), k, nb)
    if not fa:
        at = at.unsqueeze(-2)
    prod = at.matmul(bt)  # (batch, free_a, prod free_b)
    got = batch + (fa or ["?"])
    prod = prod.reshape(*prod.shape[:-1], *[sb[c] for c in fb]) if fb else prod.squeeze(-1)
    got = got + fb
    if not fa:
        prod = prod.squeeze(len(batch))
        got.remove("?")
    perm = [got.index(c) for c in out]
    return prod.permute(*perm) if perm != sorted(perm) else prod


def _explicit_einsum(eq: str, *ops: Any) -> torch.Tensor:
    """torch.einsum as MatMuls (auto_LiRPA has no einsum bound), operands folded right to
    left (the parameters' products first, in these models)."""
    if len(ops) == 1 and isinstance(ops[0], list | tuple):
        ops = tuple(ops[0])
    eq = eq.replace(" ", "")
    assert "..." not in eq and "->" in eq, eq
    ins, out = eq.split("->")
    idx = ins.split(",")
    acc, acc_idx = ops[-1], idx[-1]
    for t, ti in zip(reversed(ops[:-1]), reversed(idx[:-1]), strict=True):
        rest = out + "".join(idx[:idx.index(ti)])
        keep = "".join(c for c in dict.fromkeys(ti + acc_idx) if c in rest)
        acc, acc_idx = _einsum2(f"{ti},{acc_idx}->{keep}", t, acc), keep
    if acc_idx != out:
        acc = acc.permute(*[acc_idx.index(c) for c in out])
    return acc


@contextlib.contextmanager
def _einsum_as_matmul() -> Iterator[None]:
    """While auto_LiRPA traces the model: torch.einsum, and every imported module's own
    `einsum` name bound to it, replaced (restored after: auto_LiRPA's bounds call einsum
    themselves)."""
    orig = torch.einsum
    mods = [m for m in list(sys.modules.values()) if getattr(m, "einsum", None) is orig]
    for m in mods:
        setattr(m, "einsum", _explicit_einsum)  # noqa: B010
    try:
        yield
    finally:
        for m in mods:
            setattr(m, "einsum", orig)  # noqa: B010


def _swap_gelu(model: torch.nn.Module) -> None:
    """nn.GELU (exact, erf) replaced by auto_LiRPA's GELU module (the same function, which
    it bounds; it has no bound for Erf)."""
    from auto_LiRPA.operators.gelu import GELU

    for mod in list(model.modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.GELU):
                assert child.approximate == "none"
                setattr(mod, child_name, GELU())


def _drop_dropout(model: torch.nn.Module) -> None:
    """Every nn.Dropout (p = 0 in these models, the identity in eval mode) replaced by
    nn.Identity: auto_LiRPA's tracer puts the module in training mode and then fails on it."""
    for name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            if isinstance(child, torch.nn.Dropout):
                assert child.p == 0.0, f"{name}.{child_name}: dropout p={child.p}"
                setattr(mod, child_name, torch.nn.Identity())


class Runner:
    """One model's BoundedModule and the calls made with it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from auto_LiRPA import BoundedModule
        from safetensors.torch import load_model

        model = MODELS[spec["name"]].build()
        load_model(model, spec["weights"])
        ref_in = torch.from_numpy(np.load(spec["images"], allow_pickle=False)).float()
        with torch.no_grad():
            ref = model.eval()(ref_in)  # the model as trained, torch's own kernels
        # the model's modules call torch.nn.functional's attribute at each call
        setattr(torch.nn.functional, "scaled_dot_product_attention", _explicit_sdpa)  # noqa: B010
        # torch's fused encoder-layer kernel (its eval-mode fast path) is one opaque operator
        torch.backends.mha.set_fastpath_enabled(False)
        _drop_dropout(model)
        _swap_gelu(model)
        _explicit_attention(model)
        with torch.no_grad():
            # the rewrites keep the function: recorded beside the results
            self.rewrite_max_abs_diff = float((model.eval()(ref_in) - ref).abs().max())
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.cap = float(spec["cap_seconds"])
        self.tol = float(spec.get("bisect_tol", BISECT_TOL))
        self.deadline = time.monotonic() + float(spec["model_seconds"])
        t0 = time.monotonic()
        with _einsum_as_matmul():
            self.bm = BoundedModule(self.model, torch.zeros(1, 1, 8, 8), device="cpu",
                                    bound_opts={"verbosity": 0, **spec.get("bound_opts", {})})
        self.build_seconds = time.monotonic() - t0

    def verify(self, x0: torch.Tensor, label: int, norm: str, eps: float, method: str
               ) -> dict[str, Any]:
        """{"outcome": "verified" | "not verified" | "cap" | "oom" | "error" | "skipped",
        "seconds", "margin_lower"}."""
        from auto_LiRPA import BoundedTensor, PerturbationLpNorm

        left = self.deadline - time.monotonic()
        if left <= 1:
            return {"outcome": "skipped", "seconds": 0.0}
        others = [j for j in range(CLASSES) if j != label]
        c = torch.zeros(1, len(others), CLASSES)
        for i, j in enumerate(others):
            c[0, i, label], c[0, i, j] = 1.0, -1.0
        t0 = time.monotonic()
        signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(max(1, math.ceil(min(self.cap, left))))
        try:
            bx = BoundedTensor(x0, PerturbationLpNorm(norm=np.inf if norm == "inf" else 2.0,
                                                      eps=eps))
            lb, _ = self.bm.compute_bounds(x=(bx,), C=c, method=method, bound_upper=False)
            low = float(lb.min())
            out = {"outcome": "verified" if low > 0 else "not verified",
                   "margin_lower": low if math.isfinite(low) else None}
        except Cap:
            out = {"outcome": "cap"}
        except Exception as exc:  # the baseline's own failure is a result, recorded as such
            out = _error(exc)
        finally:
            signal.alarm(0)
        out["seconds"] = time.monotonic() - t0
        return out

    def grid(self, x0: torch.Tensor, label: int, norm: str, radii: list[float],
             methods: list[str], cells: dict[str, dict[str, Any]] | None = None
             ) -> dict[str, dict[str, Any]]:
        """Per radius (ascending), per method: the verify() cell. A method that did not
        verify a radius is not run at the larger ones (its bounds only widen with the ball:
        recorded "not verified" with "inferred"); nor after a cap or an OOM."""
        cells = {} if cells is None else cells  # more methods into earlier cells
        stopped: dict[str, str] = {}  # method -> the outcome that stopped it
        for r in sorted(radii):
            row: dict[str, Any] = cells.get(str(r), {})
            for m in methods:
                if m in stopped:
                    row[m] = {"outcome": stopped[m], "seconds": 0.0, "inferred": True}
                    continue
                crown = row.get("CROWN", {})
                if m != "CROWN" and crown.get("outcome") == "verified":
                    row[m] = {"outcome": "verified (CROWN)", "seconds": 0.0}
                    continue
                row[m] = self.verify(x0, label, norm, r, m)
                if row[m]["outcome"] in ("cap", "oom", "not verified"):
                    stopped[m] = row[m]["outcome"]
            cells[str(r)] = row
        return cells

    def radius(self, x0: torch.Tensor, label: int, norm: str, cells: dict[str, Any]
               ) -> dict[str, Any]:
        """CROWN's certified radius by geometric bisection, bracketed by the grid."""
        t0 = time.monotonic()
        rs = sorted(float(r) for r in cells)
        out = {r: cells[str(r)].get("CROWN", {}).get("outcome") for r in rs}
        if any(o not in ("verified", "not verified") for o in out.values()):
            bad = next(o for o in out.values() if o not in ("verified", "not verified"))
            return {"radius": None, "outcome": bad, "calls": 0, "seconds": 0.0}
        ok = [r for r in rs if out[r] == "verified"]
        no = [r for r in rs if out[r] == "not verified"]
        lo, hi = (max(ok) if ok else 0.0), (min(no) if no else None)
        calls = 0

        def check(eps: float) -> bool | None:
            nonlocal calls
            calls += 1
            res = self.verify(x0, label, norm, eps, "CROWN")
            if res["outcome"] not in ("verified", "not verified"):
                return None
            return bool(res["outcome"] == "verified")

        try:
            while hi is None and calls < BISECT_CALLS:  # every grid radius verified
                probe = lo * 2
                v = check(probe)
                if v is None:
                    raise Cap
                lo, hi = (probe, None) if v else (lo, probe)
            for _ in range(HALVINGS):  # none verified: halve below the grid
                if lo > 0 or hi is None:
                    break
                probe = hi / 2
                v = check(probe)
                if v is None:
                    raise Cap
                lo, hi = (probe, hi) if v else (0.0, probe)
            while lo > 0 and hi is not None and hi / lo > 1 + self.tol \
                    and calls < BISECT_CALLS:
                mid = math.sqrt(lo * hi)
                v = check(mid)
                if v is None:
                    raise Cap
                lo, hi = (mid, hi) if v else (lo, mid)
        except Cap:
            return {"radius": lo, "upper": hi, "outcome": "partial", "calls": calls,
                    "seconds": time.monotonic() - t0}
        return {"radius": lo, "upper": hi, "outcome": "ok", "calls": calls,
                "seconds": time.monotonic() - t0}


def run(spec: dict[str, Any], out_path: Path) -> dict[str, Any]:
    torch.set_num_threads(1)
    gb = spec.get("memory_gb")
    if gb:
        lim = int(float(gb) * 2 ** 30)
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    import auto_LiRPA

    doc: dict[str, Any] = {"name": spec["name"], "auto_lirpa_version": auto_LiRPA.__version__,
                           "torch": torch.__version__, "spec": spec, "images": []}
    try:
        runner = Runner(spec)
    except Exception as exc:  # a model auto_LiRPA cannot parse is a result
        doc["build"] = _error(exc)
        out_path.write_text(json.dumps(doc, indent=1))
        return doc
    doc["build"] = {"outcome": "ok", "seconds": runner.build_seconds,
                    "rewrite_max_abs_logit_diff": runner.rewrite_max_abs_diff}
    xs = np.load(spec["images"], allow_pickle=False)
    ys = np.load(spec["labels"], allow_pickle=False)
    methods = list(spec["methods"])
    images: dict[int, dict[str, Any]] = {}
    share = float(spec["model_seconds"]) / len(spec["radii"])
    for norm, radii in spec["radii"].items():
        # each norm its share of the model's time: images in order until it is spent
        runner.deadline = time.monotonic() + share
        for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if time.monotonic() >= runner.deadline:
                break
            x0 = torch.from_numpy(np.asarray(x, dtype=np.float32)).reshape(1, 1, 8, 8)
            label = int(y)
            if i not in images:
                with torch.no_grad():
                    pred = int(runner.model(x0).argmax(1))
                images[i] = {"i": i, "label": label, "predicted": pred, "norms": {}}
            t0 = time.monotonic()
            rs = [float(r) for r in radii]
            # CROWN's grid and radius first, then the other methods (alpha-CROWN's
            # optimisation may spend the time)
            first = [m for m in methods if m == "CROWN"]
            cells = runner.grid(x0, label, norm, rs, first)
            cell: dict[str, Any] = {"grid": cells}
            if spec.get("bisect", True) and first:
                cell["crown_radius"] = runner.radius(x0, label, norm, cells)
            runner.grid(x0, label, norm, rs, [m for m in methods if m != "CROWN"], cells)
            cell["seconds"] = time.monotonic() - t0
            images[i]["norms"][norm] = cell
            doc["images"] = list(images.values())
            out_path.write_text(json.dumps(doc, indent=1))
            print(f"{spec['name']} image {i} L{norm}: crown radius "
                  f"{cell.get('crown_radius', {}).get('radius')} {cell['seconds']:.1f} s",
                  file=sys.stderr, flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    doc["peak_rss_mb"] = peak / 1024
    out_path.write_text(json.dumps(doc, indent=1))
    return doc


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run(spec, Path(sys.argv[2]))


if __name__ == "__main__":
    main()
