"""The trained-models bench (bench/trained/): a digits classifier trained a few steps goes
through the bench's pipeline (train, export to ONNX, lsa loads it and computes its logits),
and lsa's verdicts on a trained model are sound: no image is certified at a radius where an
attack flips its label, and every flip lsa reports is a real one."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.trained.models import IMAGE, N_TEST, N_TRAIN, digits, pgd, torch_encoder_vit, train
from bench.trained.train import export, onnx_agreement
from lsa_models.analysis import load_model_bytes
from lsa_models.engine.routes.at_radius import decide
from lsa_models.engine.routes.certify import centre_margins
from service.bounds.local import model_image, model_input

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def data() -> tuple[torch.Tensor, ...]:
    return digits()


@pytest.fixture(scope="module")
def trained(data: tuple[torch.Tensor, ...], tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[torch.nn.Module, Path, dict]:
    """A D=16 torch-encoder ViT of the bench's kind, trained 10 epochs, exported."""
    torch.set_num_threads(1)
    model, rec = train("torch_encoder_vit", epochs=10, data=data,
                       build=lambda: torch_encoder_vit(d=16))
    path = export(model, tmp_path_factory.mktemp("trained") / "vit.onnx")
    return model, path, rec


def test_digits_split_is_fixed_and_scaled(data: tuple[torch.Tensor, ...]) -> None:
    x_tr, y_tr, x_te, y_te = data
    assert x_tr.shape == (N_TRAIN, 1, IMAGE, IMAGE) and x_te.shape == (N_TEST, 1, IMAGE, IMAGE)
    assert float(x_tr.min()) == 0.0 and float(x_tr.max()) == 1.0
    assert set(y_te.tolist()) == set(range(10))
    again = digits()
    assert torch.equal(again[2], x_te) and torch.equal(again[3], y_te)


def test_trained_model_exports_and_lsa_reads_it(trained: tuple, data: tuple) -> None:
    model, path, rec = trained
    assert rec["clean_accuracy"] > 0.5  # trained: chance is 0.1
    agree = onnx_agreement(path, model, data[2][:20])
    assert agree["max_abs_logit_diff"] < 1e-4 and agree["same_prediction"] == 1.0
    loaded = load_model_bytes(path.read_bytes(), path.name)
    x, label = data[2][0], int(data[3][0])
    xi = model_input(loaded, x.numpy().astype(np.float64))  # the image as its 16 patches
    assert xi.shape == (1, 16, 4)
    np.testing.assert_array_equal(model_image(loaded, xi).reshape(x.shape), x.numpy())
    _, _, _, margins, _ = centre_margins(loaded, xi, label, "inf")
    with torch.no_grad():
        logits = model(x[None]).double()[0]
    want = {j: float(logits[label] - logits[j]) for j in range(10) if j != label}
    assert margins.keys() == want.keys()
    for j, m in margins.items():
        assert m == pytest.approx(want[j], abs=1e-4)


@pytest.mark.timeout(120)
def test_no_certified_image_is_flipped(trained: tuple, data: tuple) -> None:
    """At a small and a large L_inf radius: a certified verdict survives a strong PGD; an
    attacked verdict's point lies in the ball and changes the torch model's class. The sweep
    is left out (minutes per input on these models); the affine walks decide fast."""
    model, path, _ = trained
    f64 = copy.deepcopy(model).double()  # lsa checks its flips in float64: so does this
    loaded = load_model_bytes(path.read_bytes(), path.name)
    x_te, y_te = data[2], data[3]
    with torch.no_grad():
        ok = torch.nonzero(model(x_te).argmax(1) == y_te).flatten()[:3]
    certified = attacked = 0
    for i in ok.tolist():
        x, label = x_te[i], int(y_te[i])
        xi = model_input(loaded, x.numpy().astype(np.float64))
        for radius in (1e-3, 0.2):
            v = decide(loaded, xi, label, "inf", radius, sweep=False)
            if v.status == "certified":
                certified += 1
                adv = pgd(model, x[None], y_te[i:i + 1], radius, "inf", steps=60,
                          restarts=4, seed=i, clip=False)  # the ball lsa certifies
                with torch.no_grad():
                    assert int(model(adv).argmax(1)) == label, (i, radius, v)
            elif v.status == "attacked":
                attacked += 1
                assert v.flip is not None and v.flip_distance is not None
                assert v.flip_distance <= radius
                point = torch.from_numpy(model_image(loaded, v.flip).reshape(1, 1, 8, 8))
                assert float((point - x[None].double()).abs().max()) <= radius * (1 + 1e-9)
                with torch.no_grad():
                    assert int(f64(point).argmax(1)) != label, (i, radius, v)
    # both kinds occur, or the checks above checked nothing
    assert certified > 0 and attacked > 0
