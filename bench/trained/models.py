"""Small classifiers trained on scikit-learn's bundled digits (1797 8x8 images; nothing
downloads), the models users bring to lsa: ViTs from timm, torch and x-transformers, an
L2-attention ViT from lsa_models' own blocks and one written from the paper's definition,
an MLP and a CNN on pixels, and one ViT trained adversarially (PGD at L_inf 0.02).

Every model maps an image (B, 1, 8, 8) with pixels in [0, 1] to logits (B, 10). The ViTs cut
the image into 16 patches of 2x2 pixels with one Conv (kernel = stride = 2) to width D = 32.
The split is fixed (1297 train / 500 test, seeded permutation), as are the initial weights
and the batch order, so `train` gives the same model on the same machine each time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

IMAGE, PATCH, D, HEADS, CLASSES = 8, 2, 32, 4, 10
N_TRAIN, N_TEST = 1297, 500
SPLIT_SEED = 0
ROBUST_EPS = 0.02  # the L_inf radius of the adversarially trained model's PGD


def digits() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x_train, y_train, x_test, y_test): float32 images (B, 1, 8, 8) in [0, 1] (the 0-16
    grey levels divided by 16) and int64 labels; a fixed seeded split of the 1797 images."""
    from sklearn.datasets import load_digits  # bundled with scikit-learn: no download

    ds = load_digits()
    x = torch.from_numpy((ds.images / 16.0).astype(np.float32)).unsqueeze(1)  # (1797, 1, 8, 8)
    y = torch.from_numpy(ds.target.astype(np.int64))
    perm = torch.from_numpy(np.random.default_rng(SPLIT_SEED).permutation(len(y)))
    tr, te = perm[:N_TRAIN], perm[N_TRAIN:N_TRAIN + N_TEST]
    return x[tr], y[tr], x[te], y[te]


class PatchEmbed(nn.Module):
    """One Conv with kernel = stride = PATCH: (B, 1, 8, 8) -> (B, 16, D) tokens, plus learnt
    positions."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.proj = nn.Conv2d(1, d, PATCH, stride=PATCH)
        self.pos = nn.Parameter(torch.randn(1, (IMAGE // PATCH) ** 2, d) * 0.02)

    def forward(self, x: Tensor) -> Tensor:  # (B, 1, 8, 8)
        return self.proj(x).flatten(2).transpose(1, 2) + self.pos  # (B, 16, D)


class MeanPoolViT(nn.Module):
    """Patch embedding, a token body (B, 16, D) -> (B, 16, D), mean over tokens, linear head."""

    def __init__(self, body: nn.Module, d: int = D) -> None:
        super().__init__()
        self.embed, self.body, self.head = PatchEmbed(d), body, nn.Linear(d, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, 1, 8, 8)
        return self.head(self.body(self.embed(x)).mean(dim=1))  # (B, 10)


def timm_vit(d: int = D, depth: int = 2) -> nn.Module:
    """timm's VisionTransformer: class token, depth 2, 4 heads, its own Conv patch embedding."""
    from tests.zoo.tv_schemas import declare

    declare()  # before timm imports torchvision (tests/zoo/tv_schemas.py says why)
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=IMAGE, patch_size=PATCH, in_chans=1,
                              num_classes=CLASSES, embed_dim=d, depth=depth, num_heads=HEADS,
                              mlp_ratio=2.0, class_token=True, global_pool="token")
    for blk in model.blocks:  # eager attention: MatMul/Softmax in the graph, as users export
        blk.attn.fused_attn = False
    return model


def torch_encoder_vit(d: int = D, layers: int = 1) -> nn.Module:
    """torch's nn.TransformerEncoder: pre-norm layers, a final LayerNorm, mean pool."""
    layer = nn.TransformerEncoderLayer(d, HEADS, dim_feedforward=2 * d, dropout=0.0,
                                       batch_first=True, norm_first=True)
    body = nn.TransformerEncoder(layer, layers, norm=nn.LayerNorm(d),
                                 enable_nested_tensor=False)
    return MeanPoolViT(body, d)


def xt_vit(d: int = D, depth: int = 2) -> nn.Module:
    """x-transformers' Encoder (pre-norm, final norm) on the patch tokens, mean pool."""
    from x_transformers import Encoder

    return MeanPoolViT(Encoder(dim=d, depth=depth, heads=HEADS, attn_dim_head=d // HEADS,
                               ff_mult=2), d)


def lsa_l2_vit(d: int = D, layers: int = 2) -> nn.Module:
    """lsa_models' own Transformer (pre-norm blocks, tied L2 attention, final LayerNorm)."""
    from lsa_models.blocks import Transformer
    from lsa_models.config import TransformerConfig

    cfg = TransformerConfig(d_model=d, n_heads=HEADS, n_layers=layers, d_ff=2 * d,
                            attention="l2", final_norm=True)
    return MeanPoolViT(Transformer(cfg), d)


class PaperL2Attention(nn.Module):
    """Multi-head L2 self-attention as the paper defines it, heads by einsum:
    f^h(X) = P^h X A^h W^{V,h}, A^h = W^{Q,h} W^{Q,h T} / sqrt(D/H),
    P^h_ij = softmax_j(-||x_i W^{Q,h} - x_j W^{Q,h}||^2 / sqrt(D/H)), F = [f^1 .. f^H] W^O."""

    def __init__(self, d: int = D, heads: int = HEADS) -> None:
        super().__init__()
        self.h, self.dh = heads, d // heads
        std = d ** -0.5
        self.wq = nn.Parameter(torch.randn(heads, d, self.dh) * std)  # W^{Q,h}: (H, D, D/H)
        self.wv = nn.Parameter(torch.randn(heads, d, self.dh) * std)  # W^{V,h}: (H, D, D/H)
        self.wo = nn.Parameter(torch.randn(d, d) * std)  # W^O: (H D/H, D)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        s = math.sqrt(self.dh)
        q = torch.einsum("bnd,hde->bhne", x, self.wq)  # (B, H, N, d)
        sq = (q.unsqueeze(3) - q.unsqueeze(2)).pow(2).sum(-1)  # (B, H, N, N)
        p = torch.softmax(-sq / s, dim=-1)  # (B, H, N, N)
        a = torch.einsum("hde,hfe->hdf", self.wq, self.wq) / s  # A^h: (H, D, D)
        v = torch.einsum("bnd,hdf,hfe->bhne", x, a, self.wv)  # X A^h W^{V,h}: (B, H, N, d)
        o = torch.einsum("bhnm,bhme->bnhe", p, v).flatten(2)  # (B, N, H d)
        return o @ self.wo  # (B, N, D)


class PaperBlock(nn.Module):
    """x + F(x), then x + FFN(x): the paper's residual block, no LayerNorm."""

    def __init__(self, d: int = D) -> None:
        super().__init__()
        self.attn = PaperL2Attention(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))

    def forward(self, x: Tensor) -> Tensor:  # (B, N, D)
        x = x + self.attn(x)
        return x + self.ff(x)


def paper_l2_vit(d: int = D, layers: int = 2) -> nn.Module:
    return MeanPoolViT(nn.Sequential(*(PaperBlock(d) for _ in range(layers))), d)


def mlp(hidden: int = 64) -> nn.Module:
    """An MLP on the flattened image."""
    return nn.Sequential(nn.Flatten(), nn.Linear(IMAGE * IMAGE, hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))


def cnn(c: int = 16) -> nn.Module:
    """Two 3x3 convolutions (the second with stride 2), ReLU, a linear head."""
    return nn.Sequential(nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(2 * c * (IMAGE // 2) ** 2, CLASSES))


@dataclass(frozen=True)
class Spec:
    """How one bench model is built and trained."""

    build: Callable[[], nn.Module]
    epochs: int
    lr: float = 3e-3
    robust_eps: float = 0.0  # > 0: PGD adversarial training at this L_inf radius
    describe: str = ""


MODELS: dict[str, Spec] = {
    "timm_vit": Spec(timm_vit, 30, describe="timm VisionTransformer, depth 2, 4 heads, "
                     "class token"),
    "torch_encoder_vit": Spec(torch_encoder_vit, 30, describe="torch nn.TransformerEncoder, "
                              "1 pre-norm layer, final LayerNorm, mean pool"),
    "xt_vit": Spec(xt_vit, 30, describe="x-transformers Encoder, depth 2, mean pool"),
    "lsa_l2_vit": Spec(lsa_l2_vit, 30, describe="lsa_models Transformer, 2 pre-norm blocks, "
                       "tied L2 attention, final LayerNorm, mean pool"),
    "paper_l2_vit": Spec(paper_l2_vit, 30, lr=6e-3, describe="the paper's L2 attention in "
                         "plain torch (einsum heads), 2 residual blocks, no LayerNorm, "
                         "mean pool"),
    "mlp": Spec(mlp, 30, describe="MLP on the flattened image, 64-64"),
    "cnn": Spec(cnn, 20, describe="CNN, conv 3x3 16, conv 3x3/2 32, linear"),
    "torch_encoder_vit_pgd": Spec(torch_encoder_vit, 30, robust_eps=ROBUST_EPS,
                                  describe="torch_encoder_vit trained with PGD at L_inf "
                                  f"{ROBUST_EPS}"),
}


def pgd(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor, norm: str, *,
        steps: int = 20, restarts: int = 1, seed: int = 0, clip: bool = True) -> Tensor:
    """Projected gradient ascent on the cross-entropy inside the ball ||delta||_norm <= eps
    (per image; norm "inf" or "2"; `eps` one radius or one per image), pixels kept in
    [0, 1] when `clip` (else the whole ball, the set lsa certifies): the points found, one
    per image, the first restart that flips the label kept. An attack: any flip it finds is
    real, what it misses proves nothing."""
    gen = torch.Generator().manual_seed(seed)
    if isinstance(eps, Tensor):
        eps = eps.to(x.dtype).view(-1, 1, 1, 1)
    step = 2.5 * eps / steps
    best = x.clone()
    flipped = torch.zeros(len(x), dtype=torch.bool)
    for r in range(restarts):
        delta = _project(_random_start(x, eps, norm, gen) if r else torch.zeros_like(x),
                         x, eps, norm, clip)
        for _ in range(steps):
            delta.requires_grad_(True)
            loss = nn.functional.cross_entropy(model(x + delta), y)
            (g,) = torch.autograd.grad(loss, delta)
            with torch.no_grad():
                if norm == "inf":
                    delta = delta + step * g.sign()
                else:
                    gn = g.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
                    delta = delta + step * g / gn
                delta = _project(delta, x, eps, norm, clip)
        with torch.no_grad():
            hit = (model(x + delta).argmax(1) != y) & ~flipped
            best[hit] = (x + delta)[hit]
            flipped |= hit
        if bool(flipped.all()):
            break
    return best.detach()


def _random_start(x: Tensor, eps: float | Tensor, norm: str, gen: torch.Generator) -> Tensor:
    u = torch.rand(x.shape, generator=gen) * 2 - 1
    if norm == "inf":
        return u * eps
    return u / u.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1) * eps * 0.5


def _project(delta: Tensor, x: Tensor, eps: float | Tensor, norm: str, clip: bool) -> Tensor:
    if norm == "inf":
        delta = torch.maximum(torch.minimum(delta, torch.as_tensor(eps)), -torch.as_tensor(eps))
    else:
        n = delta.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
        delta = delta * torch.clamp(eps / n.clamp_min(1e-12), max=1.0)
    return (x + delta).clamp(0.0, 1.0) - x if clip else delta


def accuracy(model: nn.Module, x: Tensor, y: Tensor) -> float:
    model.eval()
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train(name: str, *, epochs: int | None = None, steps: int | None = None, seed: int = 0,
          batch: int = 64, data: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
          build: Callable[[], nn.Module] | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """Train MODELS[name] (built by `build` instead where given: a smaller model of the same
    kind for tests) with Adam (one-cycle learning rate) from a seeded start; `steps` caps the
    number of batches. (the model in eval mode, its record: clean test accuracy, epochs,
    steps, seconds)."""
    spec = MODELS[name]
    x_tr, y_tr, x_te, y_te = data if data is not None else digits()
    torch.manual_seed(seed)
    model = (build or spec.build)()
    n_epochs = spec.epochs if epochs is None else epochs
    per_epoch = math.ceil(len(y_tr) / batch)
    total = n_epochs * per_epoch if steps is None else min(steps, n_epochs * per_epoch)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.lr, total_steps=total,
                                                pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.monotonic()
    done = 0
    while done < total:
        model.train()
        for idx in torch.randperm(len(y_tr), generator=gen).split(batch):
            if done == total:
                break
            xb, yb = x_tr[idx], y_tr[idx]
            if spec.robust_eps > 0:
                # the radius ramps up over the first third of training (PGD from the start
                # stalls small models at chance), then 7 steps of PGD
                eps = spec.robust_eps * min(1.0, 3 * done / total + 0.05)
                model.eval()
                xb = pgd(model, xb, yb, eps, "inf", steps=7, seed=done)
                model.train()
            loss = nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            done += 1
    model.eval()
    record = {"name": name, "describe": spec.describe, "epochs": n_epochs, "steps": done,
              "robust_eps": spec.robust_eps, "train_seconds": time.monotonic() - t0,
              "clean_accuracy": accuracy(model, x_te, y_te),
              "parameters": sum(p.numel() for p in model.parameters())}
    return model, record
