"""The lsa-vs-auto_LiRPA bench (bench/trained/compare_alirpa.py): the comparison's shaping on
a fabricated runner output and fabricated lsa rows, and the runner's einsum rewrite (the
only arithmetic it adds to the models auto_LiRPA bounds). No auto_LiRPA venv needed."""

from __future__ import annotations

import pytest
import torch

from bench.trained.abcrown import parse
from bench.trained.alirpa import _explicit_einsum
from bench.trained.compare_alirpa import RADII, compare, table


def _lsa_image(i: int, inf: tuple[str, str, str], r_inf: float | None,
               two: tuple[str, str, str], r_two: float | None) -> dict:
    def norm(statuses: tuple[str, str, str], radii: tuple[float, ...], r: float | None
             ) -> dict:
        return {"grid": {str(x): {"status": s, "seconds": 1.0}
                         for x, s in zip(radii, statuses, strict=True)},
                "radius": {"radius": r, "outcome": "ok"}, "seconds": 3.0}

    return {"i": i, "label": 0, "norms": {"inf": norm(inf, RADII["inf"], r_inf),
                                          "2": norm(two, RADII["2"], r_two)}}


def _runner_image(i: int, crown_inf: tuple[str, str, str], alpha_inf: tuple[str, str, str],
                  r_inf: float | None, crown_two: tuple[str, str, str],
                  alpha_two: tuple[str, str, str], r_two: float | None) -> dict:
    def norm(crown: tuple[str, ...], alpha: tuple[str, ...], radii: tuple[float, ...],
             r: float | None) -> dict:
        return {"grid": {str(x): {"CROWN": {"outcome": c, "seconds": 0.5},
                                  "alpha-CROWN": {"outcome": a, "seconds": 2.0}}
                         for x, c, a in zip(radii, crown, alpha, strict=True)},
                "crown_radius": {"radius": r, "outcome": "ok" if r is not None else "cap"}}

    return {"i": i, "label": 0, "predicted": 0,
            "norms": {"inf": norm(crown_inf, alpha_inf, RADII["inf"], r_inf),
                      "2": norm(crown_two, alpha_two, RADII["2"], r_two)}}


C, A, U, N = "certified", "attacked", "unknown", "not verified"
V, VC = "verified", "verified (CROWN)"


def test_compare_shapes_accuracy_ratios_and_targets() -> None:
    lsa = {"images": [_lsa_image(0, (C, C, A), 0.015, (C, U, U), 0.06),
                      _lsa_image(1, (C, A, A), 0.006, (C, C, C), 0.3),
                      _lsa_image(2, (C, C, C), 0.05, (C, C, C), 0.5)]}  # not in the runner's
    base = {"build": {"outcome": "ok"}, "images": [
        _runner_image(0, (V, N, N), (VC, V, N), 0.009, (V, N, N), (VC, N, N), 0.055),
        _runner_image(1, (N, N, N), (N, N, N), 0.002, ("cap", "cap", "cap"),
                      ("oom", "oom", "oom"), None)]}
    out = compare(lsa, base)
    assert (out["images_lsa"], out["images_alirpa"]) == (3, 2)
    inf = out["norms"]["inf"]
    assert inf["images_common"] == 2
    acc = inf["certified_accuracy"]
    # lsa certifies image 0 and 1 at 0.005, image 0 only at 0.01, none at 0.02
    assert [acc[str(r)]["lsa"] for r in RADII["inf"]] == [1.0, 0.5, 0.0]
    assert [acc[str(r)]["CROWN"] for r in RADII["inf"]] == [0.5, 0.0, 0.0]
    # "verified (CROWN)" counts as alpha-CROWN verified
    assert [acc[str(r)]["alpha-CROWN"] for r in RADII["inf"]] == [0.5, 0.5, 0.0]
    assert inf["accuracy_target_met"] is True
    ratios = {p["i"]: p["ratio"] for p in inf["images"]}
    assert ratios[0] == pytest.approx(0.015 / 0.009) and ratios[1] == pytest.approx(3.0)
    assert inf["crown_answered"] == 2 and inf["ratio_target_met"] is True
    assert inf["min_ratio"] == pytest.approx(0.015 / 0.009)
    two = out["norms"]["2"]
    acc2 = two["certified_accuracy"]
    # a cap or an OOM is no answer: not certified, and not counted as answered
    assert acc2["0.05"]["CROWN"] == 0.5 and acc2["0.05"]["CROWN_answered"] == 1
    assert acc2["0.05"]["alpha-CROWN_answered"] == 1
    assert [acc2[str(r)]["lsa"] for r in RADII["2"]] == [1.0, 0.5, 0.5]
    # CROWN gave a radius on image 0 only: 0.06 / 0.055 < 1.5
    assert two["crown_answered"] == 1 and two["ratio_target_met"] is False
    assert [p["ratio"] for p in two["images"]][1] is None
    text = table({"models": {"m": {"compare": out}}})
    assert "| m | inf | 2 |" in text and "0.005: 1.0/0.5/0.5" in text


def test_compare_flags_accuracy_below_alpha_crown_and_no_common_images() -> None:
    lsa = {"images": [_lsa_image(0, (U, U, U), 0.001, (U, U, U), 0.01)]}
    base = {"images": [_runner_image(0, (V, V, N), (VC, VC, V), 0.015, (N, N, N),
                                     (N, N, N), 0.02)]}
    inf = compare(lsa, base)["norms"]["inf"]
    assert inf["accuracy_target_met"] is False and inf["ratio_target_met"] is False
    empty = compare(lsa, {"build": {"outcome": "error", "message": "unsupported"},
                          "images": []})
    assert empty["norms"]["inf"]["images_common"] == 0
    assert empty["alirpa_build"]["outcome"] == "error"
    assert empty["norms"]["inf"]["accuracy_target_met"] is None
    assert empty["norms"]["inf"]["certified_accuracy"]["0.01"]["lsa"] is None


@pytest.mark.parametrize("eq, shapes", [
    ("bnd,hde->bhne", [(1, 5, 6), (3, 6, 2)]),
    ("hde,hfe->hdf", [(3, 6, 2), (3, 4, 2)]),
    ("bnd,hdf,hfe->bhne", [(1, 5, 6), (3, 6, 4), (3, 4, 2)]),
    ("bhnm,bhme->bnhe", [(1, 3, 5, 5), (1, 3, 5, 2)]),
    ("b h i d, b h j d -> b h i j", [(2, 3, 5, 4), (2, 3, 6, 4)]),
    ("nd,d->n", [(5, 6), (6,)]),
])
def test_einsum_rewrite_matches_torch(eq: str, shapes: list[tuple[int, ...]]) -> None:
    gen = torch.Generator().manual_seed(0)
    ops = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    torch.testing.assert_close(_explicit_einsum(eq, *ops), torch.einsum(eq, *ops))


def test_compare_keeps_only_images_both_sides_finished_in_each_norm() -> None:
    skipped = _lsa_image(1, (C, C, C), 0.03, ("skipped",) * 3, None)
    lsa = {"images": [_lsa_image(0, (C, A, A), 0.006, (C, C, U), 0.12), skipped]}
    late = _runner_image(1, (V, V, V), (VC, VC, VC), 0.025, (V, "skipped", "skipped"),
                         (VC, "skipped", "skipped"), None)
    base = {"images": [_runner_image(0, (V, N, N), (VC, N, N), 0.006, (V, V, N),
                                     (VC, VC, N), 0.11), late]}
    del late["norms"]["inf"]["grid"]  # the runner ran out of time before this image's L_inf
    out = compare(lsa, base)
    assert out["norms"]["inf"]["images_common"] == 1
    assert out["norms"]["2"]["images_common"] == 1
    assert out["norms"]["2"]["certified_accuracy"]["0.1"] == {
        "lsa": 1.0, "CROWN": 1.0, "CROWN_answered": 1, "alpha-CROWN": 1.0,
        "alpha-CROWN_answered": 1}
    assert [p["i"] for p in out["norms"]["inf"]["images"]] == [0]


def test_compare_puts_branch_and_bound_beside_on_the_same_images_only() -> None:
    lsa = {"images": [_lsa_image(0, (C, C, A), 0.015, (C, U, U), 0.06),
                      _lsa_image(1, (C, A, A), 0.006, (C, C, C), 0.3)]}
    base = {"images": [
        _runner_image(0, (V, N, N), (VC, V, N), 0.009, (V, N, N), (VC, N, N), 0.055),
        _runner_image(1, (N, N, N), (N, N, N), 0.002, (V, V, N), (VC, VC, N), 0.2)]}
    done = {"safe-incomplete": [0, 1]}
    bab = {"inf": {"0.005": {"images": [0, 1], "verified": [0, 1], "status": done},
                   "0.01": {"images": [0, 1], "verified": [0, 1], "status": done},
                   "0.02": {"images": [0], "verified": [0], "status": done}},  # not the same
           "2": {"0.05": {"images": [0, 1], "verified": [], "status": {}, "killed": "cap"}}}
    inf = compare(lsa, base, bab)["norms"]["inf"]
    acc = inf["certified_accuracy"]
    assert acc["0.005"]["alpha-beta-CROWN"] == 1.0 and acc["0.01"]["alpha-beta-CROWN"] == 1.0
    assert "alpha-beta-CROWN" not in acc["0.02"]
    two = compare(lsa, base, bab)["norms"]["2"]["certified_accuracy"]["0.05"]
    assert "alpha-beta-CROWN" not in two and two["alpha-beta-CROWN_no_answer"] == "cap"
    # lsa 0.5 at 0.01 against BaB's 1.0
    assert inf["accuracy_target_met_bab"] is False
    assert compare(lsa, base)["norms"]["inf"]["accuracy_target_met_bab"] is None


def test_abcrown_summary_parsing() -> None:
    log = ("Result: safe-incomplete in 0.2 seconds\n"
           "############# Summary #############\n"
           "safe-incomplete (total 2), index: [0, 3]\n"
           "unknown (total 1), index: [1]\n"
           "unsafe-pgd (total 1), index: [2]\n")
    assert parse(log) == {"safe-incomplete": [0, 3], "unknown": [1], "unsafe-pgd": [2]}
