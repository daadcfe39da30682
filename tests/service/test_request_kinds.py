"""The request bodies of POST /certify and POST /bound: a `kind` per shape (OpenAPI: oneOf
with a discriminator, each shape with its own required fields and examples); a body without
`kind` is still read as before, with a Deprecation header; bad bodies are 422 naming the
field."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from .conftest import upload

CERTIFY_KINDS = {
    "lipschitz": ("LipschitzRequest", {"kind", "model_id", "max_lipschitz"}),
    "robustness": ("RobustnessRequest", {"kind", "model_id", "at", "label", "min_radius"}),
    "certified_accuracy": ("CertifiedAccuracyRequest",
                           {"kind", "model_id", "inputs", "labels", "min_radius",
                            "min_certified_accuracy"}),
    "training": ("TrainingRequest", {"kind", "training"}),
}
BOUND_KINDS = {
    "global": ("GlobalBoundRequest", {"kind", "model_id"}),
    "local": ("LocalBoundRequest", {"kind", "model_id", "at", "eps"}),
    "empirical": ("EmpiricalBoundRequest", {"kind", "model_id", "empirical"}),
}


@pytest.mark.parametrize("path,kinds", [("/certify", CERTIFY_KINDS), ("/bound", BOUND_KINDS)])
def test_openapi_lists_each_kind_as_one_of_with_a_discriminator(
        client: TestClient, path: str, kinds: dict[str, tuple[str, set[str]]]) -> None:
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    body = schemas[ref["$ref"].rsplit("/", 1)[1]]
    assert body["discriminator"]["propertyName"] == "kind"
    assert body["discriminator"]["mapping"] == {
        kind: f"#/components/schemas/{name}" for kind, (name, _) in kinds.items()}
    assert sorted(o["$ref"] for o in body["oneOf"]) == sorted(
        f"#/components/schemas/{name}" for name, _ in kinds.values())
    assert [e["kind"] for e in body["examples"]] == list(kinds)
    for kind, (name, required) in kinds.items():
        shape = schemas[name]
        assert set(shape["required"]) == required, name
        assert shape["properties"]["kind"]["const"] == kind
        assert shape["additionalProperties"] is False
        assert [e["kind"] for e in shape["examples"]] == [kind]


def test_a_body_without_kind_still_answers_with_a_deprecation_header(
        client: TestClient, model_bytes: bytes) -> None:
    m = upload(client, model_bytes)
    old = client.post("/certify", json={"model_id": m["id"], "max_lipschitz": 1e12,
                                        "seq_len": 4})
    assert old.status_code == 201, old.text
    assert old.headers["deprecation"] == "true"
    assert "kind=lipschitz" in old.headers["warning"] and "send kind" in old.headers["warning"]
    new = client.post("/certify", json={"kind": "lipschitz", "model_id": m["id"],
                                        "max_lipschitz": 1e12, "seq_len": 4})
    assert new.status_code == 201 and "deprecation" not in new.headers
    assert {k: v for k, v in new.json().items() if k not in ("id", "issued_at", "signature")} \
        == {k: v for k, v in old.json().items() if k not in ("id", "issued_at", "signature")}
    old_bound = client.post("/bound", json={"model_id": m["id"], "seq_len": 4})
    new_bound = client.post("/bound", json={"kind": "global", "model_id": m["id"],
                                            "seq_len": 4})
    assert old_bound.status_code == new_bound.status_code == 200
    assert old_bound.headers["deprecation"] == "true" and "kind=global" in \
        old_bound.headers["warning"] and "deprecation" not in new_bound.headers
    assert old_bound.json() == new_bound.json()


@pytest.mark.parametrize("body,needle", [
    # the old bodies keep their messages
    ({"max_lipschitz": 10.0}, "model_id: required"),
    ({"model_id": "m", "at": [[1.0]], "max_lipschitz": 1.0, "label": 0, "min_radius": 0.1},
     "max_lipschitz: not with at/label/min_radius"),
    ({"model_id": "m", "sweep": False, "max_lipschitz": 1.0}, "sweep: only with inputs"),
    # the explicit ones name the field of their kind
    ({"kind": "robustness", "model_id": "m", "at": [[1.0]], "min_radius": 0.1},
     "robustness.label: Field required"),
    ({"kind": "lipschitz", "model_id": "m", "max_lipschitz": 1.0, "at": [[1.0]]},
     "lipschitz.at: Extra inputs are not permitted"),
    ({"kind": "certified_accuracy", "model_id": "m", "inputs": [[[1.0]], [[1.0, 2.0]]],
      "labels": [0, 0], "min_radius": 0.1, "min_certified_accuracy": 0.5},
     "every input needs the same shape"),
    ({"kind": "robustness", "model_id": "m", "at": [[1.0], [1.0, 2.0]], "label": 0,
      "min_radius": 0.1}, "at: ragged nested lists"),
    ({"kind": "lipschitz_bound", "model_id": "m"},
     "'lipschitz', 'robustness', 'certified_accuracy', 'training'"),
    ({"kind": None, "model_id": "m"}, "kind"),
])
def test_bad_certify_bodies_are_422_naming_the_field(client: TestClient, body: dict[str, Any],
                                                     needle: str) -> None:
    r = client.post("/certify", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"], r.json()


@pytest.mark.parametrize("body,needle", [
    ({"model_id": "m", "eps": 0.1}, "eps: only with at"),
    ({"model_id": "m", "at": [[1.0]], "eps": 0.1, "radius": 1.0}, "radius: not with at"),
    ({"kind": "local", "model_id": "m", "at": [[1.0]]}, "local.eps: Field required"),
    ({"kind": "global", "model_id": "m", "eps": 0.1}, "global.eps: Extra inputs"),
    ({"kind": "empirical", "model_id": "m"}, "empirical.empirical: Field required"),
    ({"kind": "ball", "model_id": "m"}, "'global', 'local', 'empirical'"),
])
def test_bad_bound_bodies_are_422_naming_the_field(client: TestClient, body: dict[str, Any],
                                                   needle: str) -> None:
    r = client.post("/bound", json=body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"], r.json()
