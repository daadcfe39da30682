"""The zoo's cases: model, input layout, the right verdict, and what lsa says today where it
does not reach it (the recognition work of issue 12 flips those).

Right verdicts (docs/certification.md): tied L2 attention and dot-product attention behind a
LayerNorm/RMSNorm (bounded inputs: pre-norm blocks, BERT-style normalised embeddings) are
Lipschitz: "certified"; dot-product attention reached without a normalisation (post-norm
blocks, bare attention) is "not_lipschitz"; untied L2 attention is "not_certified" (lsa
rightly refuses it). Layout names: "(N, D)", "(1, N, D)", "(N, 1, D)", "ids" (token ids),
"inputs_embeds", "pixels", "patches" (patch embeddings, before the CLS token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from . import models_ext as ext
from . import models_l2 as l2
from . import models_torch as tm

EXPORTERS = ("torchscript", "dynamo")
N, D, H = 6, 16, 2  # hand-written and torch models
NH, DH = 8, 32  # library models (HF, timm, x-transformers): N tokens, width D
IMAGE, PATCH = 16, 8  # 4 patches + class token(s)


# Exports torch 2.13 cannot do (the zoo leaves them out; docs/supported-models.md lists them)
NOT_EXPORTABLE = {
    ("l2-cdist*", "dynamo"): "no ONNX function for aten::_cdist_forward",
    ("torch-encoder-* (batch-first and sequence-first 3-D input)", "torchscript"):
        "nn.TransformerEncoderLayer: 'is_causal must be bool, not Tensor' (the 2-D "
        "`layer(x.unsqueeze(0)).squeeze(0)` wrapping exports)",
}


@dataclass
class Built:
    """What a case exports (`module` on `example`) and what the lower bound differentiates:
    `continuous` on inputs shaped like `continuous_shape` (the map lsa bounds: for token ids,
    the model after its embedding lookup, i.e. on inputs_embeds)."""

    module: nn.Module
    example: Tensor
    continuous: nn.Module
    continuous_shape: tuple[int, ...]


@dataclass(frozen=True)
class Case:
    model: str  # the model's name in the table; cases of one model share their lower bound
    layout: str
    build: Callable[[], Built]
    expected: str  # the right verdict
    exporters: tuple[str, ...] = EXPORTERS

    @property
    def key(self) -> str:
        return f"{self.model}[{self.layout}]"


def _seeded(fn: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return fn().eval()


def _float(module: nn.Module, shape: tuple[int, ...], continuous: nn.Module | None = None,
           cshape: tuple[int, ...] | None = None) -> Built:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, generator=gen)
    return Built(module, x, continuous or module, cshape or shape)


def _layouts(make: Callable[[], nn.Module], layouts: tuple[str, ...]
             ) -> dict[str, Callable[[], Built]]:
    """Builders of one batch-first `(..., N, D)` module in the requested layouts."""
    out: dict[str, Callable[[], Built]] = {}
    if "(1, N, D)" in layouts:
        out["(1, N, D)"] = lambda: _float(_seeded(make), (1, N, D))
    if "(N, D)" in layouts:
        out["(N, D)"] = lambda: _float(_seeded(make), (N, D))
    if "(N, 1, D)" in layouts:
        out["(N, 1, D)"] = lambda: _float(l2.SeqFirst(_seeded(make)), (N, 1, D))
    return out


def _cases_l2() -> list[Case]:
    cases: list[Case] = []

    def add(model: str, make: Callable[[], nn.Module], layouts: tuple[str, ...],
            expected: str = "certified") -> None:
        exporters = ("torchscript",) if "cdist" in model else EXPORTERS
        for layout, build in _layouts(make, layouts).items():
            cases.append(Case(model, layout, build, expected, exporters=exporters))

    add("l2-broadcast", lambda: l2.L2Broadcast(D, H), ("(N, D)", "(1, N, D)", "(N, 1, D)"))
    add("l2-broadcast-1head-causal", lambda: l2.L2Broadcast(D, 1, causal=True), ("(1, N, D)",))
    add("l2-broadcast-residual", lambda: l2.Residual(l2.L2Broadcast(D, H)), ("(1, N, D)",))
    add("l2-broadcast-untied", lambda: l2.L2Broadcast(D, H, tied=False), ("(1, N, D)",),
        "not_certified")
    add("l2-cdist", lambda: l2.L2Cdist(D, H), ("(N, D)", "(1, N, D)"))
    add("l2-cdist-untied", lambda: l2.L2Cdist(D, H, tied=False), ("(1, N, D)",),
        "not_certified")
    add("l2-expanded", lambda: l2.L2Expanded(D, H), ("(N, D)", "(1, N, D)"))
    add("l2-expanded-1head-causal", lambda: l2.L2Expanded(D, 1, causal=True), ("(N, D)",))
    add("l2-expanded-untied", lambda: l2.L2Expanded(D, H, tied=False), ("(1, N, D)",),
        "not_certified")
    for causal in (True, False):
        name = "l2-stpp-causal" if causal else "l2-stpp"
        cases.append(Case(name, "(N, 1, D)", lambda causal=causal: _float(  # type: ignore[misc]
            _seeded(lambda: l2.L2Stpp(D, H, causal)), (N, 1, D)), "certified"))
    # neural_stpp's own mask: triu(full(-1e9), 1) added
    cases.append(Case("l2-stpp-causal-1e9", "(N, 1, D)", lambda: _float(
        _seeded(lambda: l2.L2Stpp(D, H, True, mask=-1e9)), (N, 1, D)), "certified"))
    add("l2-einsum-folded", lambda: l2.L2EinsumHeads(D, H), ("(1, N, D)",))
    add("l2-einsum-folded-residual-2", lambda: nn.Sequential(
        l2.Residual(l2.L2EinsumHeads(D, H)), l2.Residual(l2.L2EinsumHeads(D, H))), ("(1, N, D)",))
    add("l2-einsum-queries-first", lambda: l2.L2EinsumHeads(D, H, "queries"), ("(1, N, D)",))
    add("l2-einsum-independent", lambda: l2.L2EinsumHeads(D, H, "independent"), ("(1, N, D)",),
        "not_certified")
    cases.append(Case("l2-cdist-values-after", "(N, D)", lambda: _float(
        _seeded(lambda: l2.CdistValuesAfter(D, 8)), (N, D)), "certified",
        exporters=("torchscript",)))
    return cases


def _cases_torch() -> list[Case]:
    cases: list[Case] = []
    for norm_first in (True, False):
        kind = "prenorm" if norm_first else "postnorm"
        verdict = "certified" if norm_first else "not_lipschitz"

        def enc(nf: bool = norm_first) -> nn.Module:
            return tm.encoder_layer(D, H, nf)

        cases.append(Case(f"torch-encoder-{kind}", "(1, N, D)",
                          lambda enc=enc: _float(_seeded(enc), (1, N, D)), verdict,  # type: ignore[misc]
                          exporters=("dynamo",)))
        cases.append(Case(f"torch-encoder-{kind}", "(N, D)", lambda enc=enc: _float(  # type: ignore[misc]
            tm.Unbatched(_seeded(enc)), (N, D)), verdict))
        cases.append(Case(f"torch-encoder-{kind}", "(N, 1, D)", lambda nf=norm_first: _float(  # type: ignore[misc]
            _seeded(lambda: tm.encoder_layer(D, H, nf, batch_first=False)), (N, 1, D)), verdict,
            exporters=("dynamo",)))
        cases.append(Case(f"torch-decoder-{kind}", "(1, N, D)", lambda nf=norm_first: _float(  # type: ignore[misc]
            _seeded(lambda: tm.DecoderOnly(D, H, N, nf)), (1, N, D)), verdict))
    cases += [
        Case("torch-mha-causal-prenorm", "(1, N, D)", lambda: _float(_seeded(
            lambda: tm.MHABlock(D, H, N, pre_norm=True, bool_mask=False)), (1, N, D)),
            "certified"),
        Case("torch-mha-boolmask", "(1, N, D)", lambda: _float(_seeded(
            lambda: tm.MHABlock(D, H, N, pre_norm=False, bool_mask=True)), (1, N, D)),
            "not_lipschitz"),
        Case("sdpa-causal-prenorm", "(1, N, D)", lambda: _float(_seeded(
            lambda: tm.SDPABlock(D, H, N, pre_norm=True, causal=True)), (1, N, D)),
            "certified"),
        Case("sdpa-mask-prenorm", "(1, N, D)", lambda: _float(_seeded(
            lambda: tm.SDPABlock(D, H, N, pre_norm=True, causal=False)), (1, N, D)),
            "certified"),
        Case("sdpa-causal", "(1, N, D)", lambda: _float(_seeded(
            lambda: tm.SDPABlock(D, H, N, pre_norm=False, causal=True)), (1, N, D)),
            "not_lipschitz"),
    ]
    return cases


def _hf_text(model: str, make: Callable[[], nn.Module]) -> list[Case]:
    def embeds() -> Built:
        m = ext.HFEmbeds(_seeded(make))
        return _float(m, (1, NH, DH))

    def ids() -> Built:
        base = _seeded(make)
        x = torch.randint(0, 64, (1, NH), generator=torch.Generator().manual_seed(1))
        return Built(ext.HFIds(base), x, ext.HFEmbeds(base), (1, NH, DH))

    return [Case(model, "inputs_embeds", embeds, "certified"),
            Case(model, "ids", ids, "certified")]


def _vision(model: str, make: Callable[[], nn.Module], pixels: type[nn.Module],
            patches: type[nn.Module]) -> list[Case]:
    p = (IMAGE // PATCH) ** 2
    return [
        Case(model, "pixels", lambda: _float(pixels(_seeded(make)), (1, 3, IMAGE, IMAGE)),
             "certified"),
        Case(model, "patches", lambda: _float(patches(_seeded(make)), (1, p, DH)),
             "certified"),
    ]


def _cases_ext() -> list[Case]:
    cases = _hf_text("hf-gpt2", lambda: ext.gpt2(DH, 2, 2, NH))
    cases += _hf_text("hf-bert", lambda: ext.bert(DH, 2, 1))
    cases += _hf_text("hf-distilbert", lambda: ext.distilbert(DH, 2, 1))
    cases += _hf_text("hf-llama", lambda: ext.llama(DH, 2, 1))
    cases += _vision("hf-vit", lambda: ext.hf_vit(DH, 2, 1, IMAGE, PATCH), ext.HFViTPixels,
                     ext.HFViTPatches)
    cases += _vision("timm-vit", lambda: ext.timm_vit(DH, 2, 1, IMAGE, PATCH),
                     ext.TimmPixels, ext.TimmPatches)
    cases += _vision("timm-deit-distilled",
                     lambda: ext.timm_vit(DH, 2, 1, IMAGE, PATCH, distilled=True),
                     ext.TimmPixels, ext.TimmPatches)
    for causal in (False, True):
        name = "xt-decoder" if causal else "xt-encoder"
        cases.append(Case(name, "(1, N, D)", lambda causal=causal: _float(  # type: ignore[misc]
            _seeded(lambda: ext.xt_encoder(DH, 2, 1, causal)), (1, NH, DH)), "certified"))
    return cases


CASES: list[Case] = _cases_l2() + _cases_torch() + _cases_ext()
