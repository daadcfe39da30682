"""Multi-head self-attention: dot-product (DP-MHA) and L2 (L2-MHA), as in docs/theory.md.

Built like torch's layers: `DotProductMHA(d_model, n_heads, *, causal=False)`,
`L2MHA(d_model, n_heads, *, tied=True, causal=False)`. Each keeps its arguments as an
`AttentionConfig` in `.config` (what checkpoints store); `from_config` rebuilds a layer from one.

Weights follow torch's `nn.Linear` layout (out, in); the row-vector matrices of the paper are
their transposes: `W^Q = q_proj.weight.T` (D x D), and head h owns columns h*d:(h+1)*d.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from .config import AttentionConfig, ConfigError


def _split_heads(x: Tensor, n_heads: int) -> Tensor:
    b, n, dm = x.shape
    return x.view(b, n, n_heads, dm // n_heads).transpose(1, 2)  # (B, H, N, d)


def _merge_heads(x: Tensor) -> Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)  # (B, N, D)


class DotProductMHA(nn.Module):
    """`F(X) = [softmax(X W^Q_h (X W^K_h)^T / sqrt(d)) X W^V_h]_h W^O`.

    Not Lipschitz on R^{N x D} (Theorem 3.1)."""

    def __init__(self, d_model: int, n_heads: int, *, causal: bool = False) -> None:
        super().__init__()
        config = AttentionConfig(d_model, n_heads, "dp", causal=causal)  # validates
        self.config = config
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.d_model ** -0.5
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_config(cls, config: AttentionConfig) -> DotProductMHA:
        """The layer a checkpoint's `AttentionConfig` describes (its `tied` means nothing
        here: dot-product attention has separate key weights by definition)."""
        if config.kind != "dp":
            raise ConfigError("kind", f"DotProductMHA needs kind='dp', got {config.kind!r}; "
                              "build L2MHA for kind='l2'")
        return cls(config.d_model, config.n_heads, causal=config.causal)

    def extra_repr(self) -> str:
        c = self.config
        return f"d_model={c.d_model}, n_heads={c.n_heads}, causal={c.causal}"

    def forward(self, x: Tensor) -> Tensor:  # x: (B, N, D)
        h = self.config.n_heads
        q = _split_heads(self.q_proj(x), h)  # (B, H, N, d)
        k = _split_heads(self.k_proj(x), h)  # (B, H, N, d)
        v = _split_heads(self.v_proj(x), h)  # (B, H, N, d)
        y = _sdpa(q, k, v, self.config.causal, self.config.head_dim**-0.5)  # (B, H, N, d)
        return self.out_proj(_merge_heads(y))  # (B, N, D)


class L2MHA(nn.Module):
    """L2 multi-head self-attention (Kim et al. 2021), efficient form.

    Logits `-||q_i - k_j||^2 / sqrt(d)` equal `(2 q_i.k_j - ||k_j||^2) / sqrt(d)` up to a
    per-row constant, so they are a scaled dot product (scale 2/sqrt(d)) of augmented vectors
    `[q_i, 1/2] . [k_j, -||k_j||^2]`, which `scaled_dot_product_attention` runs unmasked.
    The value path `X A_h W^V_h` with `A_h = W^Q_h W^K_h^T / sqrt(d)` equals
    `Q_h (W^K_h^T W^V_h) / sqrt(d)`; the d x d factor is folded into the output projection,
    so the values are the (augmented) queries themselves and no value projection runs per
    token. The output projection is one fused product with bias (`attend` + addmm).
    """

    def __init__(self, d_model: int, n_heads: int, *, tied: bool = True,
                 causal: bool = False) -> None:
        super().__init__()
        config = AttentionConfig(d_model, n_heads, "l2", tied=tied, causal=causal)  # validates
        self.config = config
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        # Untied keys are allowed for experiments; the bound analyser refuses to certify them.
        self.k_proj: nn.Linear | None = (
            None if config.tied else nn.Linear(d_model, d_model, bias=False)
        )
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.config.d_model ** -0.5
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.out_proj):
            if lin is not None:
                nn.init.normal_(lin.weight, mean=0.0, std=std)
        nn.init.zeros_(self.out_proj.bias)

    @classmethod
    def from_config(cls, config: AttentionConfig) -> L2MHA:
        """The layer a checkpoint's `AttentionConfig` describes."""
        if config.kind != "l2":
            raise ConfigError("kind", f"L2MHA needs kind='l2', got {config.kind!r}; build "
                              "DotProductMHA for kind='dp'")
        return cls(config.d_model, config.n_heads, tied=config.tied, causal=config.causal)

    def extra_repr(self) -> str:
        c = self.config
        return f"d_model={c.d_model}, n_heads={c.n_heads}, tied={c.tied}, causal={c.causal}"

    # Per-head matrices in the paper's row-vector convention.
    def query_weights(self) -> Tensor:
        """`W^{Q,h}` for every head: (H, D, d)."""
        return _head_columns(self.q_proj.weight, self.config.n_heads)

    def key_weights(self) -> Tensor:
        """`W^{K,h}` for every head: (H, D, d); the query weights when tied."""
        lin = self.q_proj if self.k_proj is None else self.k_proj
        return _head_columns(lin.weight, self.config.n_heads)

    def value_weights(self) -> Tensor:
        """`W^{V,h}` for every head: (H, D, d)."""
        return _head_columns(self.v_proj.weight, self.config.n_heads)

    def output_weight(self) -> Tensor:
        """`W^O`: (D, D), row-vector convention."""
        return self.out_proj.weight.T

    def folded_output_weight(self) -> Tensor:
        """`blockdiag_h(W^K_h^T W^V_h / sqrt(d)) W^O`: (D, D), applied to the merged queries."""
        h, d = self.config.n_heads, self.config.head_dim
        wk = self.key_weights()  # (H, D, d)
        wv = self.value_weights()  # (H, D, d)
        m = torch.einsum("hke,hkf->hef", wk, wv) / math.sqrt(d)  # (H, d, d)
        wo = self.output_weight().reshape(h, d, -1)  # (H, d, D)
        return torch.bmm(m, wo).reshape(h * d, -1)  # (D, D)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, N, D)
        # One fused product-plus-bias (addmm) for the output projection.
        return F.linear(self.attend(x), self.folded_output_weight().transpose(0, 1),
                        self.out_proj.bias)  # (B, N, D)

    def attend(self, x: Tensor) -> Tensor:  # x: (B, N, D) -> (B, N, D)
        """The merged head outputs `[P_h X W^Q_h]_h` before the folded output projection:
        `forward(x) = attend(x) @ folded_output_weight() + out_proj.bias`."""
        cfg = self.config
        d = cfg.head_dim
        q = _split_heads(self.q_proj(x), cfg.n_heads)  # (B, H, N, d)
        k = q if self.k_proj is None else _split_heads(self.k_proj(x), cfg.n_heads)
        # `[q, 1/2] . [k, -|k|^2]` at scale 2/sqrt(d) is the logit `(2 q.k - |k|^2)/sqrt(d)`,
        # and the same augmented queries serve as the values (their first d columns are q).
        # The fused kernels need one head size e >= d + 1 for all three; zero columns pad
        # them at no change in value (they add 0 to every logit and give output columns
        # that are dropped). e = max(16, d + 1) on CPU (one thread, N = 64-256, fwd+bwd: at
        # d = 16, e = 17 runs 10-15% faster than e = 24, and e = 16 beats every smaller
        # size), a multiple of 8 elsewhere (the CUDA kernels' requirement).
        e = max(16, d + 1) if q.device.type == "cpu" else -(-(d + 1) // 8) * 8
        cols = [torch.full_like(q[..., :1], 0.5)]  # (B, H, N, 1)
        kcols = [-(k * k).sum(-1, keepdim=True)]  # (B, H, N, 1)
        if e > d + 1:
            pad = q.new_zeros(*q.shape[:-1], e - d - 1)  # (B, H, N, e-d-1)
            cols.append(pad)
            kcols.append(pad)
        q_aug = torch.cat([q, *cols], dim=-1)  # (B, H, N, e)
        k_aug = torch.cat([k, *kcols], dim=-1)  # (B, H, N, e)
        y = _sdpa(q_aug, k_aug, q_aug, cfg.causal, 2.0 / math.sqrt(d))[..., :d]  # (B, H, N, d)
        return _merge_heads(y)  # (B, N, D)

    def forward_export(self, x: Tensor, form: str = "pairwise") -> Tensor:
        """The definition in an exporter-friendly form: explicit logits (pairwise differences
        or the expanded `2 q.k - |q|^2 - |k|^2`) and the value path `Q_h W^K_h^T W^V_h /
        sqrt(d)` with `W^V` kept separate, so that ONNX recognition can read W^Q, W^V, W^O."""
        cfg = self.config
        d = cfg.head_dim
        q = _split_heads(self.q_proj(x), cfg.n_heads)  # (B, H, N, d)
        k = q if self.k_proj is None else _split_heads(self.k_proj(x), cfg.n_heads)
        if form == "pairwise":
            diff = q.unsqueeze(3) - k.unsqueeze(2)  # (B, H, N, N, d)
            logits = -(diff * diff).sum(-1) / math.sqrt(d)  # (B, H, N, N)
        elif form == "expanded":
            qk = q @ k.transpose(-1, -2)  # (B, H, N, N)
            qq = (q * q).sum(-1, keepdim=True)  # (B, H, N, 1)
            kk = (k * k).sum(-1).unsqueeze(-2)  # (B, H, 1, N)
            logits = (2.0 * qk - qq - kk) / math.sqrt(d)  # (B, H, N, N)
        else:
            raise ValueError(f"unknown L2 logits form {form!r}; use 'pairwise' or 'expanded'")
        if cfg.causal:
            n = x.shape[1]
            mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
            logits = logits.masked_fill(mask, float("-inf"))
        p = torch.softmax(logits, dim=-1)  # (B, H, N, N)
        z = (q @ self.key_weights().transpose(1, 2)) / math.sqrt(d)  # (B, H, N, D) = X A_h
        v = z @ self.value_weights()  # (B, H, N, d)
        return self.out_proj(_merge_heads(p @ v))  # (B, N, D)

    def forward_reference(self, x: Tensor) -> Tensor:
        """The definition, written out with explicit pairwise differences; for tests only."""
        cfg = self.config
        b, n, _ = x.shape
        d = cfg.head_dim
        wq, wk, wv = self.query_weights(), self.key_weights(), self.value_weights()
        heads = []
        for h in range(cfg.n_heads):
            q = x @ wq[h]  # (B, N, d)
            k = x @ wk[h]  # (B, N, d)
            diff = q[:, :, None, :] - k[:, None, :, :]  # (B, N, N, d)
            logits = -(diff * diff).sum(-1) / math.sqrt(d)  # (B, N, N)
            if cfg.causal:
                mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
                logits = logits.masked_fill(mask, float("-inf"))
            p = torch.softmax(logits, dim=-1)  # (B, N, N)
            a = wq[h] @ wk[h].T / math.sqrt(d)  # (D, D)
            heads.append(p @ (x @ a @ wv[h]))  # (B, N, d)
        return torch.cat(heads, dim=-1) @ self.output_weight() + self.out_proj.bias


def _in_function_transform() -> bool:
    """Inside torch.func (jvp, jacrev, vmap, grad) or a forward-AD dual level."""
    level = getattr(torch._C._functorch, "maybe_current_level", lambda: None)()
    return level is not None or getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    if not _in_function_transform():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    # torch's fused CPU kernel has neither forward-mode AD nor a differentiable backward, which
    # Jacobian norms (jvp/vjp) and their gradients need; the math kernel computes the same
    # function with full autograd support.
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def _head_columns(weight: Tensor, n_heads: int) -> Tensor:
    """torch (out, in) weight -> per-head row-vector matrices (H, in, out/H)."""
    out_features, in_features = weight.shape
    return weight.T.reshape(in_features, n_heads, out_features // n_heads).permute(1, 0, 2)


def build_attention(config: AttentionConfig) -> DotProductMHA | L2MHA:
    """The layer for a stored `AttentionConfig` (blocks and checkpoints)."""
    return L2MHA.from_config(config) if config.kind == "l2" else DotProductMHA.from_config(config)
