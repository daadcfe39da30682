"""A small synchronous client for the lsa REST API (what `lsa certify --server` uses).

Timeouts on every request; retries with exponential backoff on 5xx answers and on connection
errors (refused, reset, timed out), because a CI job should survive a server restart or a
rolling deploy. 4xx answers are never retried: they say the request itself is wrong.
Retrying a POST is safe here: uploads are content-addressed (the same bytes give the same
id) and a repeated /certify at worst issues a second, equally valid certificate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from api_schemas.bounds import BoundReport
from api_schemas.certificates import Certificate, Counterexamples, VerifyResult

RETRY_STATUS = frozenset({500, 502, 503, 504})
JOB_DONE = frozenset({"succeeded", "failed", "cancelled"})

# (stage, progress in [0, 1] or None) -> None; called while waiting for a job.
ProgressFn = Callable[[str, float | None], None]


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    api_key: str | None = None
    timeout_s: float = 60.0
    connect_timeout_s: float = 5.0
    retries: int = 4  # attempts after the first
    backoff_s: float = 0.5
    backoff_max_s: float = 8.0
    poll_interval_s: float = 0.5  # between job polls when the server sends no Retry-After
    poll_max_s: float = 30.0  # the longest Retry-After honoured between job polls
    job_timeout_s: float = 3600.0

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"server URL must start with http:// or https://, got "
                             f"{self.base_url!r}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if not self.timeout_s > 0 or not self.connect_timeout_s > 0:
            raise ValueError("timeouts must be > 0")


class ClientError(Exception):
    """Anything that kept a request from producing an answer the caller can use."""


class ServerUnreachable(ClientError):
    """Connection errors or timeouts persisted through every retry."""


class APIError(ClientError):
    """The server answered with an error status; `error`/`detail` come from its `{error,
    detail}` body when it has one."""

    def __init__(self, status: int, error: str, detail: Any, method: str, path: str) -> None:
        self.status = status
        self.error = error
        self.detail = detail
        detail_text = detail if isinstance(detail, str) else repr(detail)
        super().__init__(f"{method} {path}: HTTP {status} {error}: {detail_text}")


class JobFailed(ClientError):
    def __init__(self, job_id: str, status: str, error: Any) -> None:
        self.job_id = job_id
        self.status = status
        super().__init__(f"job {job_id} {status}: {error}")


def retry_after_s(resp: httpx.Response, cap: float) -> float:
    """The Retry-After header in seconds (0 when absent or not a number), at most `cap`."""
    try:
        return min(max(float(resp.headers.get("retry-after", "0")), 0.0), cap)
    except ValueError:
        return 0.0


def _api_error(resp: httpx.Response, method: str, path: str) -> APIError:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and "error" in body:
        return APIError(resp.status_code, str(body["error"]), body.get("detail"), method, path)
    if isinstance(body, dict) and "detail" in body:  # FastAPI's default shape
        return APIError(resp.status_code, resp.reason_phrase, body["detail"], method, path)
    text = resp.text.strip()[:500] or resp.reason_phrase
    return APIError(resp.status_code, resp.reason_phrase, text, method, path)


class LSAClient:
    """One client per server. `transport` and `sleep` are injectable for tests."""

    def __init__(self, config: ClientConfig, *, transport: httpx.BaseTransport | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config = config
        self._sleep = sleep
        headers = {"User-Agent": "lsa-client"}
        if config.api_key:
            headers["Authorization"] = f"Bearer {config.api_key}"
        self._http = httpx.Client(
            base_url=config.base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(config.timeout_s, connect=config.connect_timeout_s),
            transport=transport,
            follow_redirects=True,
        )

    def __enter__(self) -> LSAClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based): doubling, capped."""
        return float(min(self.config.backoff_max_s, self.config.backoff_s * 2 ** attempt))

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """Send with retries; return a 2xx response or raise APIError / ServerUnreachable."""
        last: Exception | None = None
        wait_at_least = 0.0  # the server's Retry-After (503 busy), capped like the backoff
        for attempt in range(self.config.retries + 1):
            if attempt:
                self._sleep(max(self.backoff(attempt - 1), wait_at_least))
            try:
                resp = self._http.request(method, path, **kwargs)
            except httpx.TransportError as exc:  # connect/read/write errors and timeouts
                last = exc
                continue
            if resp.status_code in RETRY_STATUS:
                last = _api_error(resp, method, path)
                wait_at_least = retry_after_s(resp, self.config.backoff_max_s)
                continue
            if resp.is_error:
                raise _api_error(resp, method, path)
            return resp
        if isinstance(last, APIError):
            raise last
        raise ServerUnreachable(
            f"{self.config.base_url}: {type(last).__name__}: {last or 'no answer'} (after "
            f"{self.config.retries + 1} attempts); is the server running and the URL right?")

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        resp = self.request(method, path, **kwargs)
        try:
            return resp.json()
        except ValueError:
            raise ClientError(f"{method} {path}: the answer is not JSON "
                              f"({resp.text[:200]!r})") from None

    # --- endpoints -------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return dict(self._json("GET", "/healthz"))

    def upload_model(self, path: Path) -> dict[str, Any]:
        """POST /models -> {id, sha256, format, summary}. Bytes are read once so every retry
        sends the same body."""
        data = Path(path).read_bytes()
        files = {"file": (Path(path).name, data, "application/octet-stream")}
        return dict(self._json("POST", "/models", files=files))

    def bound(self, model_id: str, norm: str, seq_len: int | None = None,
              radius: float | None = None, progress: ProgressFn | None = None) -> BoundReport:
        body = _drop_none({"kind": "global", "model_id": model_id, "norm": norm,
                           "seq_len": seq_len, "radius": radius})
        return BoundReport.model_validate(self._maybe_job("POST", "/bound", body, progress))

    def certify(self, model_id: str, norm: str, max_lipschitz: float,
                seq_len: int | None = None, radius: float | None = None,
                progress: ProgressFn | None = None) -> Certificate:
        body = _drop_none({"kind": "lipschitz", "model_id": model_id, "norm": norm,
                           "max_lipschitz": max_lipschitz, "seq_len": seq_len,
                           "radius": radius})
        return Certificate.model_validate(self._maybe_job("POST", "/certify", body, progress))

    def certify_robustness(self, model_id: str, at: list[Any], label: int, min_radius: float,
                           norm: str = "2", progress: ProgressFn | None = None) -> Certificate:
        """POST /certify of kind robustness: the certificate at once when the server
        has the radii, else its job polled to the certificate (its progress: the bisection
        step)."""
        body = {"kind": "robustness", "model_id": model_id, "norm": norm, "at": at,
                "label": label, "min_radius": min_radius}
        return Certificate.model_validate(self._maybe_job("POST", "/certify", body, progress))

    def certify_accuracy(self, model_id: str, inputs: list[Any], labels: list[int],
                         min_radius: float, min_certified_accuracy: float, norm: str = "2",
                         progress: ProgressFn | None = None,
                         sweep: bool = True,
                         time_budget_s: float | None | str = "default") -> Certificate:
        """POST /certify of kind certified_accuracy: its job polled
        to the certified-accuracy certificate (its progress: the inputs decided);
        `sweep=False` sends "sweep": false (no radius sweep); `time_budget_s`: each input's
        seconds, None for no budget ("default": the server's default)."""
        body: dict[str, Any] = {"kind": "certified_accuracy", "model_id": model_id,
                                "norm": norm, "inputs": inputs, "labels": labels,
                                "min_radius": min_radius,
                                "min_certified_accuracy": min_certified_accuracy}
        if not sweep:
            body["sweep"] = False
        if time_budget_s != "default":
            body["time_budget_s"] = time_budget_s
        return Certificate.model_validate(self._maybe_job("POST", "/certify", body, progress))

    def counterexamples(self, certificate_id: str) -> Counterexamples:
        """GET /certificates/{id}/counterexamples: the label flips behind a
        certified-accuracy certificate."""
        resp = self.request("GET", f"/certificates/{certificate_id}/counterexamples")
        return Counterexamples.model_validate(resp.json())

    def bound_local(self, model_id: str, at: list[Any], eps: float, norm: str = "2",
                    empirical: dict[str, Any] | None = None,
                    progress: ProgressFn | None = None) -> BoundReport:
        """POST /bound of kind local: the bound on the ball around `at` (with
        `empirical`, a job: the in-ball lower bound too)."""
        body = _drop_none({"kind": "local", "model_id": model_id, "norm": norm, "at": at,
                           "eps": eps, "empirical": empirical})
        return BoundReport.model_validate(self._maybe_job("POST", "/bound", body, progress))

    def public_key(self) -> str:
        """The server's Ed25519 public key as PEM (plain text or inside a JSON object)."""
        resp = self.request("GET", "/certificates/public-key")
        if "json" in resp.headers.get("content-type", ""):
            body = resp.json()
            values = body.values() if isinstance(body, dict) else [body]
            for value in values:
                if isinstance(value, str) and "BEGIN PUBLIC KEY" in value:
                    return value
            raise ClientError("GET /certificates/public-key: no PEM key in the answer")
        return resp.text

    def verify(self, certificate: Certificate | dict[str, Any]) -> VerifyResult:
        payload = (certificate.model_dump(mode="json") if isinstance(certificate, Certificate)
                   else certificate)
        return VerifyResult.model_validate(
            self._json("POST", "/certificates/verify", json=payload))

    def job(self, job_id: str) -> dict[str, Any]:
        return dict(self._json("GET", f"/jobs/{job_id}"))

    def poll_wait_s(self, resp: httpx.Response) -> float:
        """Seconds until the next poll of a job: the server's Retry-After when it sends one
        (capped by poll_max_s), else poll_interval_s."""
        if "retry-after" not in resp.headers:
            return self.config.poll_interval_s
        return retry_after_s(resp, self.config.poll_max_s)

    def wait_job(self, job_id: str, progress: ProgressFn | None = None,
                 first_wait_s: float | None = None) -> Any:
        """Poll until the job ends, waiting the Retry-After of each answer (`first_wait_s`:
        the 202's); return its result or raise JobFailed."""
        deadline = time.monotonic() + self.config.job_timeout_s
        if first_wait_s:
            self._sleep(first_wait_s)
        while True:
            path = f"/jobs/{job_id}"
            resp = self.request("GET", path)
            try:
                job = dict(resp.json())
            except (ValueError, TypeError):
                raise ClientError(f"GET {path}: the answer is not a JSON object") from None
            status = str(job.get("status"))
            if progress is not None:
                progress(str(job.get("stage") or status), job.get("progress"))
            if status == "succeeded":
                return job.get("result")
            if status in JOB_DONE:
                raise JobFailed(job_id, status, job.get("error"))
            if time.monotonic() > deadline:
                raise ClientError(f"job {job_id} still {status} after "
                                  f"{self.config.job_timeout_s:.0f} s")
            self._sleep(self.poll_wait_s(resp))

    def _maybe_job(self, method: str, path: str, body: dict[str, Any],
                   progress: ProgressFn | None) -> Any:
        """Synchronous answers come back directly; 202 `{job_id}` is polled to its result."""
        resp = self.request(method, path, json=body)
        try:
            data = resp.json()
        except ValueError:
            raise ClientError(f"{method} {path}: the answer is not JSON") from None
        if resp.status_code == 202 and isinstance(data, dict) and "job_id" in data:
            first = self.poll_wait_s(resp) if "retry-after" in resp.headers else None
            return self.wait_job(str(data["job_id"]), progress, first_wait_s=first)
        return data


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
