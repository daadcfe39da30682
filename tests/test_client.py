"""The httpx client: retries on 5xx and connection errors with backoff, never on 4xx;
timeouts; the API key header; job polling."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from api_schemas.bounds import BoundReport
from api_schemas.certificates import CERTIFICATE_EXAMPLE
from service.client import (
    APIError,
    ClientConfig,
    ClientError,
    JobFailed,
    LSAClient,
    ServerUnreachable,
)

BOUND_EXAMPLE: dict[str, Any] = BoundReport.model_json_schema()["examples"][0]
CERT = {**CERTIFICATE_EXAMPLE, "signature": "c2ln"}


def make_client(handler: Callable[[httpx.Request], httpx.Response], sleeps: list[float],
                **config: Any) -> LSAClient:
    cfg = ClientConfig(base_url="http://lsa.test", **config)
    return LSAClient(cfg, transport=httpx.MockTransport(handler), sleep=sleeps.append)


def scripted(answers: list[httpx.Response | Exception]
             ) -> tuple[Callable[[httpx.Request], httpx.Response], list[httpx.Request]]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return handler, seen


def test_client_retries_5xx_with_doubling_backoff() -> None:
    handler, seen = scripted([httpx.Response(503), httpx.Response(502),
                              httpx.Response(200, json={"status": "ok"})])
    sleeps: list[float] = []
    with make_client(handler, sleeps, backoff_s=0.5) as client:
        assert client.health() == {"status": "ok"}
    assert len(seen) == 3
    assert sleeps == [0.5, 1.0]


def test_client_waits_the_servers_retry_after_when_busy() -> None:
    busy = httpx.Response(503, headers={"Retry-After": "3"},
                          json={"error": "busy", "detail": "compute queue full"})
    handler, seen = scripted([busy, busy, httpx.Response(200, json={"status": "ok"})])
    sleeps: list[float] = []
    with make_client(handler, sleeps, backoff_s=0.5, backoff_max_s=8) as client:
        assert client.health() == {"status": "ok"}
    assert len(seen) == 3
    assert sleeps == [3.0, 3.0]  # Retry-After beats the shorter backoff


def test_client_retries_connection_errors() -> None:
    handler, seen = scripted([httpx.ConnectError("refused"), httpx.ReadTimeout("slow"),
                              httpx.Response(200, json={"status": "ok"})])
    sleeps: list[float] = []
    with make_client(handler, sleeps) as client:
        assert client.health()["status"] == "ok"
    assert len(seen) == 3 and len(sleeps) == 2


def test_client_gives_up_on_persistent_5xx_with_the_servers_error() -> None:
    body = {"error": "internal", "detail": "database is down"}
    handler, seen = scripted([httpx.Response(500, json=body)])
    sleeps: list[float] = []
    with make_client(handler, sleeps, retries=3) as client, pytest.raises(APIError) as info:
        client.health()
    assert len(seen) == 4
    assert info.value.status == 500 and info.value.detail == "database is down"
    assert "database is down" in str(info.value)


def test_client_never_retries_4xx() -> None:
    body = {"error": "validation_error", "detail": "norm: must be 2 or inf"}
    handler, seen = scripted([httpx.Response(422, json=body)])
    sleeps: list[float] = []
    with make_client(handler, sleeps) as client, pytest.raises(APIError) as info:
        client.certify("m1", "3", 10.0)
    assert len(seen) == 1 and sleeps == []
    assert info.value.status == 422
    assert info.value.error == "validation_error"
    assert "norm: must be 2 or inf" in str(info.value)


def test_client_backoff_is_capped() -> None:
    client = LSAClient(ClientConfig(base_url="http://x", backoff_s=1.0, backoff_max_s=5.0))
    assert [client.backoff(i) for i in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    client.close()


def test_client_sends_the_api_key_as_bearer_token() -> None:
    handler, seen = scripted([httpx.Response(200, json={"status": "ok"})])
    with make_client(handler, [], api_key="lsa_secret") as client:
        client.health()
    assert seen[0].headers["Authorization"] == "Bearer lsa_secret"
    handler, seen = scripted([httpx.Response(200, json={"status": "ok"})])
    with make_client(handler, []) as client:
        client.health()
    assert "Authorization" not in seen[0].headers


def test_client_rejects_a_url_without_scheme() -> None:
    with pytest.raises(ValueError, match="http:// or https://"):
        ClientConfig(base_url="localhost:8000")


def test_client_upload_sends_multipart_file_field(tmp_path: Path) -> None:
    model = tmp_path / "m.safetensors"
    model.write_bytes(b"model-bytes")
    handler, seen = scripted([httpx.Response(503), httpx.Response(
        201, json={"id": "m1", "sha256": "0" * 64, "format": "native", "summary": {}})])
    with make_client(handler, []) as client:
        assert client.upload_model(model)["id"] == "m1"
    # The retried request carries the whole file again.
    for request in seen:
        body = request.read()
        assert b'name="file"; filename="m.safetensors"' in body and b"model-bytes" in body


def test_client_polls_a_202_job_to_its_result() -> None:
    answers = {
        "/bound": [httpx.Response(202, json={"job_id": "j1"})],
        "/jobs/j1": [
            httpx.Response(200, json={"status": "queued", "progress": None, "stage": None,
                                      "result": None, "error": None}),
            httpx.Response(200, json={"status": "running", "progress": 0.5,
                                      "stage": "bounding", "result": None, "error": None}),
            httpx.Response(200, json={"status": "succeeded", "progress": 1.0, "stage": "done",
                                      "result": BOUND_EXAMPLE, "error": None}),
        ],
    }
    calls: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        i = calls.get(request.url.path, 0)
        calls[request.url.path] = i + 1
        return answers[request.url.path][i]

    progress: list[tuple[str, float | None]] = []
    sleeps: list[float] = []
    with make_client(handler, sleeps, poll_interval_s=0.25) as client:
        report = client.bound("m1", "2", 128, progress=lambda s, p: progress.append((s, p)))
    assert report == BoundReport.model_validate(BOUND_EXAMPLE)
    assert progress == [("queued", None), ("bounding", 0.5), ("done", 1.0)]
    assert sleeps == [0.25, 0.25]


def test_client_robustness_job_honours_retry_after() -> None:
    cert = {**CERTIFICATE_EXAMPLE, "signature": "c2ln",
            "robustness": {"label": 1, "certified_radius": 0.03}}
    answers = {
        "/certify": [httpx.Response(202, json={"job_id": "j7", "status": "queued",
                                               "url": "/jobs/j7"},
                                    headers={"Retry-After": "2", "Location": "/jobs/j7"})],
        "/jobs/j7": [
            httpx.Response(200, json={"status": "running", "progress": 0.4,
                                      "stage": "radius sweep 7/30, certified 0.041"},
                           headers={"Retry-After": "3"}),
            httpx.Response(200, json={"status": "running", "progress": 0.5,
                                      "stage": "radius sweep 8/30, certified 0.041"}),
            httpx.Response(200, json={"status": "succeeded", "progress": 1.0,
                                      "stage": "done", "result": cert}),
        ],
    }
    seen: list[dict[str, object]] = []
    calls: dict[str, int] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/certify":
            seen.append(json.loads(request.read()))
        i = calls.get(request.url.path, 0)
        calls[request.url.path] = i + 1
        return answers[request.url.path][i]

    stages: list[str] = []
    sleeps: list[float] = []
    with make_client(handler, sleeps, poll_interval_s=0.25) as client:
        got = client.certify_robustness("m1", [[0.0, 1.0]], 1, 0.01,
                                        progress=lambda s, p: stages.append(s))
    assert got.robustness == cert["robustness"] and got.id == cert["id"]
    assert seen == [{"kind": "robustness", "model_id": "m1", "norm": "2",
                     "at": [[0.0, 1.0]], "label": 1, "min_radius": 0.01}]
    # The 202's Retry-After before the first poll, each answer's after it; none: the default.
    assert sleeps == [2.0, 3.0, 0.25]
    assert stages[0] == "radius sweep 7/30, certified 0.041"


def test_client_failed_job_raises_with_its_error() -> None:
    answers = iter([httpx.Response(202, json={"job_id": "j2"}),
                    httpx.Response(200, json={"status": "failed", "progress": 0.3,
                                              "stage": "bounding", "result": None,
                                              "error": "out of memory"})])
    with make_client(lambda r: next(answers), []) as client, pytest.raises(JobFailed) as info:
        client.certify("m1", "2", 10.0)
    assert "out of memory" in str(info.value) and info.value.status == "failed"


def test_client_certify_parses_the_certificate_and_sends_the_request_body() -> None:
    handler, seen = scripted([httpx.Response(201, json=CERT)])
    with make_client(handler, []) as client:
        cert = client.certify("m1", "inf", 10.0, seq_len=64)
    assert cert.model_dump(mode="json")["model_sha256"] == CERT["model_sha256"]
    assert json.loads(seen[0].content) == {"kind": "lipschitz", "model_id": "m1",
                                           "norm": "inf", "max_lipschitz": 10.0,
                                           "seq_len": 64}


def test_client_rejects_an_answer_that_breaks_the_schema() -> None:
    handler, _ = scripted([httpx.Response(201, json={**CERT, "upper": "lots"})])
    with make_client(handler, []) as client, pytest.raises(ValueError):
        client.certify("m1", "2", 10.0)


@pytest.mark.parametrize("content_type,body", [
    ("application/json", '{"public_key": "-----BEGIN PUBLIC KEY-----\\nAAA\\n"}'),
    ("text/plain", "-----BEGIN PUBLIC KEY-----\nAAA\n"),
])
def test_client_public_key_from_json_or_text(content_type: str, body: str) -> None:
    handler, _ = scripted([httpx.Response(200, text=body,
                                          headers={"content-type": content_type})])
    with make_client(handler, []) as client:
        assert client.public_key().startswith("-----BEGIN PUBLIC KEY-----\nAAA")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_client_unreachable_server_is_reported_after_retries() -> None:
    sleeps: list[float] = []
    cfg = ClientConfig(base_url=f"http://127.0.0.1:{free_port()}", retries=2)
    with LSAClient(cfg, sleep=sleeps.append) as client, pytest.raises(ServerUnreachable) as e:
        client.health()
    assert len(sleeps) == 2
    assert "ConnectError" in str(e.value) and "3 attempts" in str(e.value)


@pytest.fixture
def silent_server() -> Iterator[str]:
    """Accepts connections and never answers: only a read timeout ends a request."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    sock.close()


def test_client_times_out_on_a_silent_server(silent_server: str) -> None:
    sleeps: list[float] = []
    cfg = ClientConfig(base_url=silent_server, timeout_s=0.2, retries=1)
    with LSAClient(cfg, sleep=sleeps.append) as client, pytest.raises(ServerUnreachable) as e:
        client.health()
    assert "ReadTimeout" in str(e.value)
    assert len(sleeps) == 1


def test_client_non_json_answer_is_a_client_error() -> None:
    handler, _ = scripted([httpx.Response(200, text="<html>proxy</html>")])
    with make_client(handler, []) as client, pytest.raises(ClientError, match="not JSON"):
        client.health()


def test_client_verify_posts_the_certificate() -> None:
    handler, seen = scripted([httpx.Response(200, json={"valid": False,
                                                        "reason": "signature does not match"})])
    with make_client(handler, []) as client:
        result = client.verify(CERT)
    assert not result.valid and "does not match" in result.reason
    assert seen[0].url.path == "/certificates/verify"
    assert json.loads(seen[0].content) == CERT


def test_client_gives_up_on_a_job_that_never_ends() -> None:
    handler, seen = scripted([httpx.Response(200, json={
        "status": "running", "progress": 0.1, "stage": "training", "result": None,
        "error": None})])
    with make_client(handler, [], job_timeout_s=0.0) as client, \
            pytest.raises(ClientError, match="still running"):
        client.wait_job("j9")
    assert [r.url.path for r in seen] == ["/jobs/j9"]
