"""`at` on an upload on pixels (summary layout "pixels"): the image (1, C, H, W) or (C, H, W)
is cut into the patches (P, C*kh*kw) the graph takes, in one place
(service.bounds.local.model_input), exactly as the graph puts them back together; REST and CLI
give the same local bound for both image shapes; any other shape is 422 / exit 2 naming both
accepted shapes; a robustness request on an image is queued with the patches' centre."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from torch import Tensor, nn
from typer.testing import CliRunner

from lsa_models.analysis import load_model_bytes
from lsa_models.engine.drivers.centre import center_sha256
from service.bounds.local import model_input
from service.cli import app as cli

from .conftest import upload

C, H, W, KH, KW, D, CLASSES = 2, 4, 6, 2, 3, 6, 3  # 2 x 2 patches of 2*2*3 = 12 pixels


class PixelClassifier(nn.Module):
    """A ViT-style patch embedding (non-square kernel == stride) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Conv2d(C, D, (KH, KW), stride=(KH, KW))
        self.head = nn.Linear((H // KH) * (W // KW) * D, CLASSES)

    def forward(self, x: Tensor) -> Tensor:  # (B, C, H, W)
        t = self.proj(x).flatten(2).transpose(1, 2)  # (B, P, D)
        return self.head(torch.tanh(t).flatten(1))  # (B, CLASSES)


@pytest.fixture
def pixel_onnx(tmp_path: Path) -> tuple[Path, nn.Module]:
    torch.manual_seed(uuid.uuid4().int % 2**31)
    model = PixelClassifier().eval()
    path = tmp_path / "pixels.onnx"
    torch.onnx.export(model, (torch.randn(1, C, H, W),), str(path), dynamo=False,
                      opset_version=18, input_names=["x"], output_names=["logits"])
    return path, model


@pytest.fixture
def image() -> np.ndarray:
    return np.random.default_rng(3).standard_normal((1, C, H, W))  # (1, C, H, W)


def test_pixels_model_input_cuts_the_image_as_the_graph_does(
        pixel_onnx: tuple[Path, nn.Module], image: np.ndarray) -> None:
    path, model = pixel_onnx
    loaded = load_model_bytes(path.read_bytes(), path.name)
    assert loaded.summary["layout"] == "pixels"
    patches = model_input(loaded, image)
    assert patches.shape == (1, (H // KH) * (W // KW), C * KH * KW)  # (1, P, C kh kw)
    assert np.array_equal(model_input(loaded, image[0]), patches)
    # The graph on the patches is the upload on the image (float64, to rounding).
    graph = loaded.onnx.module.with_dtype(torch.float64)
    with torch.no_grad():
        on_patches = graph(torch.from_numpy(patches)).numpy()
        on_image = model.double()(torch.from_numpy(image)).numpy()
    np.testing.assert_allclose(on_patches, on_image, rtol=1e-12, atol=1e-12)
    # A permutation: the same norms, so the same balls.
    assert np.linalg.norm(patches) == pytest.approx(np.linalg.norm(image), rel=1e-15)
    assert sorted(patches.reshape(-1)) == sorted(image.reshape(-1))
    with pytest.raises(ValueError, match=r"\(1, C, H, W\) = \(1, 2, 4, 6\) or \(C, H, W\) = "
                                         r"\(2, 4, 6\)"):
        model_input(loaded, patches)


def test_pixels_local_bound_rest_takes_both_image_shapes_and_equals_the_cli(
        client: TestClient, pixel_onnx: tuple[Path, nn.Module], image: np.ndarray,
        tmp_path: Path) -> None:
    path, _ = pixel_onnx
    m = upload(client, path.read_bytes(), "pixels.onnx")
    loaded = load_model_bytes(path.read_bytes(), path.name)
    req = {"model_id": m["id"], "norm": "2", "eps": 0.01}
    four = client.post("/bound", json={**req, "at": image.tolist()})
    assert four.status_code == 200, four.text
    three = client.post("/bound", json={**req, "at": image[0].tolist()})
    assert three.status_code == 200 and three.json() == four.json()
    report = four.json()
    assert report["domain"]["center_sha256"] == center_sha256(model_input(loaded, image))
    assert report["seq_len"] == (H // KH) * (W // KW)
    np.save(tmp_path / "img.npy", image[0])
    res = CliRunner().invoke(cli, ["bound", str(path), "--at", str(tmp_path / "img.npy"),
                                   "--eps", "0.01", "--json"])
    assert res.exit_code == 0, res.output
    local = json.loads(res.stdout)
    assert local["upper"] == report["upper"] and local["domain"] == report["domain"]


def test_pixels_wrong_shape_is_422_and_exit_2_naming_both_shapes(
        client: TestClient, pixel_onnx: tuple[Path, nn.Module], image: np.ndarray,
        tmp_path: Path) -> None:
    path, _ = pixel_onnx
    m = upload(client, path.read_bytes(), "pixels.onnx")
    loaded = load_model_bytes(path.read_bytes(), path.name)
    patches = model_input(loaded, image)
    both = "(1, C, H, W) = (1, 2, 4, 6) or (C, H, W) = (2, 4, 6)"
    for at in (patches, image[:, :, :, :-3], image[0, 0]):
        for url, body in (("/bound", {"eps": 0.01}),
                          ("/certify", {"label": 0, "min_radius": 0.01})):
            r = client.post(url, json={"model_id": m["id"], "at": at.tolist(), **body})
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert detail.startswith("at: ") and both in detail, detail
    np.save(tmp_path / "patches.npy", patches)
    for cmd in (["bound", str(path), "--at", str(tmp_path / "patches.npy"), "--eps", "0.1"],
                ["robustness", str(path), "--at", str(tmp_path / "patches.npy"), "--label",
                 "0"]):
        res = CliRunner().invoke(cli, cmd)
        assert res.exit_code == 2, res.output
        assert "--at: shape (1, 4, 12)" in res.stderr and both in res.stderr


def test_pixels_robustness_request_is_queued_on_the_patches(
        client: TestClient, pixel_onnx: tuple[Path, nn.Module], image: np.ndarray) -> None:
    path, model = pixel_onnx
    m = upload(client, path.read_bytes(), "pixels.onnx")
    loaded = load_model_bytes(path.read_bytes(), path.name)
    with torch.no_grad():
        label = int(model.double()(torch.from_numpy(image)).argmax())
    r = client.post("/certify", json={"model_id": m["id"], "at": image[0].tolist(),
                                      "label": label, "min_radius": 1e-6})
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while (job := client.get(r.json()["url"]).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline, job
        time.sleep(0.1)
    # the local engine's Conv rule (lsa_models/engine/enclosure/rules_conv.py) certifies the patch
    # embedding: the job succeeds on the patches' centre
    assert job["status"] == "succeeded", job
    rob = job["result"]["robustness"]
    assert rob["center_sha256"] == center_sha256(model_input(loaded, image))
    assert rob["label"] == label == rob["predicted"]
    assert rob["certified_radius"] > 0, rob


def test_pixels_certified_accuracy_certificate_takes_images(
        client: TestClient, pixel_onnx: tuple[Path, nn.Module], tmp_path: Path) -> None:
    """POST /certify with images as inputs: cut into patches once at the request, decided in
    the job as the CLI decides the same images (the same statuses); its counterexamples are
    images that flip the original torch model; a patch array instead of an image is 422
    naming the input."""
    path, model = pixel_onnx
    m = upload(client, path.read_bytes(), "pixels.onnx")
    imgs = np.random.default_rng(4).standard_normal((3, C, H, W))
    with torch.no_grad():
        labels = model.double()(torch.from_numpy(imgs)).argmax(-1).tolist()
    req = {"model_id": m["id"], "norm": "2", "inputs": imgs.tolist(), "labels": labels,
           "min_radius": 0.01, "min_certified_accuracy": 0.5}
    r = client.post("/certify", json=req)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 120
    while (job := client.get(r.json()["url"]).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert job["status"] == "succeeded", job
    rs = job["result"]["robustness_set"]
    assert rs["n"] == 3 and "misclassified" not in rs["statuses"]
    np.save(tmp_path / "imgs.npy", imgs)
    np.save(tmp_path / "ys.npy", np.array(labels))
    res = CliRunner().invoke(cli, ["robustness", str(path), "--inputs", str(tmp_path /
                                   "imgs.npy"), "--labels", str(tmp_path / "ys.npy"),
                                   "--radius", "0.01", "--json"])
    assert res.exit_code == 0, res.output
    assert [s["status"] for s in json.loads(res.stdout)["samples"]] == rs["statuses"]
    # at a radius the attack flips: the counterexamples are images that flip the torch model
    big = {**req, "min_radius": 3.0}
    r = client.post("/certify", json=big)
    deadline = time.monotonic() + 120
    while (job := client.get(r.json()["url"]).json())["status"] in ("queued", "running"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    flips = client.get(f"/certificates/{job['result']['id']}/counterexamples").json()
    assert len(flips["counterexamples"]) == job["result"]["robustness_set"]["counts"][
        "attacked"] >= 1
    for c in flips["counterexamples"]:
        img = np.asarray(c["input"])
        assert img.shape == (1, C, H, W) and np.linalg.norm(img - imgs[c["index"]]) <= 3.0
        with torch.no_grad():
            assert int(model.double()(torch.from_numpy(img)).argmax()) == c["flip_class"]
    loaded = load_model_bytes(path.read_bytes(), path.name)
    patches = model_input(loaded, imgs[:1])[0]
    bad = client.post("/certify", json={**req, "inputs": [patches.tolist()] * 3})
    assert bad.status_code == 422 and bad.json()["detail"].startswith("inputs[0]: "), bad.text
