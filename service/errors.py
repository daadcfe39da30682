"""One typed error hierarchy; each class fixes its status code. One handler renders them all as
`{"error": code, "detail": message}`, as do validation errors and unknown routes."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api_schemas.errors import ErrorBody

log = logging.getLogger("lsa.service")


class ServiceError(Exception):
    status_code = 500
    error = "internal_error"

    def __init__(self, detail: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.headers = headers


class BadRequest(ServiceError):
    status_code = 400
    error = "bad_request"


class Unauthorized(ServiceError):
    status_code = 401
    error = "unauthorized"

    def __init__(self, detail: str) -> None:
        super().__init__(detail, headers={"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    status_code = 403
    error = "forbidden"


class NotFound(ServiceError):
    status_code = 404
    error = "not_found"


class Conflict(ServiceError):
    status_code = 409
    error = "conflict"


class PayloadTooLarge(ServiceError):
    status_code = 413
    error = "payload_too_large"


class Unprocessable(ServiceError):
    status_code = 422
    error = "unprocessable"


class InvalidModel(Unprocessable):
    """The upload is not a model the service reads (bad format, bad config, bad tensors)."""

    error = "invalid_model"


class InvalidRequest(Unprocessable):
    """The request is well-formed but does not fit the model (e.g. wrong seq_len)."""

    error = "invalid_request"


class ModelTooLarge(Unprocessable):
    error = "model_too_large"


class ServiceUnavailable(ServiceError):
    status_code = 503
    error = "unavailable"


def error_response(status: int, error: str, detail: str,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorBody(error=error, detail=detail).model_dump()
    return JSONResponse(body, status_code=status, headers=headers)


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts) or "invalid request"


_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
               405: "method_not_allowed", 406: "not_acceptable", 413: "payload_too_large",
               415: "unsupported_media_type", 422: "unprocessable"}


def install_error_handlers(app: FastAPI) -> None:
    async def on_service_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ServiceError)
        return error_response(exc.status_code, exc.error, exc.detail, exc.headers)

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(422, "validation_error", _validation_detail(exc))

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        detail: Any = exc.detail
        return error_response(exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"),
                              str(detail), getattr(exc, "headers", None))

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, "internal_error",
                              f"unexpected server error ({type(exc).__name__}); see the logs")

    app.add_exception_handler(ServiceError, on_service_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": desc}
    for code, desc in {
        401: "Missing or unknown API key (when LSA_AUTH_REQUIRED=true)",
        403: "The API key's scope does not allow this",
        404: "No such resource",
        422: "Invalid input: the detail says what is wrong",
    }.items()
}


def responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error codes a route can return (plus auth errors)."""
    descriptions = {400: "Bad request", 409: "Conflict with the resource's state",
                    413: "Upload larger than LSA_MAX_UPLOAD_BYTES",
                    503: "Not ready, or busy: retry after the Retry-After seconds"}
    out: dict[int | str, dict[str, Any]] = {c: ERROR_RESPONSES[c] for c in (401, 403, 422)}
    for c in codes:
        out[c] = ERROR_RESPONSES.get(c) or {"model": ErrorBody, "description": descriptions[c]}
    return out


class BodyLimitMiddleware:
    """413 in the common error shape for bodies past the limit: at once when Content-Length
    says so, else as soon as the streamed body crosses it (nothing larger is ever buffered)."""

    def __init__(self, app: ASGIApp, max_bytes: int, max_json_bytes: int | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # JSON bodies (e.g. an input `at` of POST /bound) are parsed whole in memory: they get
        # their own, smaller limit so a huge body is refused at once, not parsed for minutes.
        self.max_json_bytes = max_json_bytes or max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        is_json = headers.get(b"content-type", b"").split(b";")[0].strip() == b"application/json"
        limit = self.max_json_bytes if is_json else self.max_bytes
        detail = self._too_large_detail(is_json)
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > limit:
            await error_response(413, PayloadTooLarge.error, detail)(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # Starlette's HTTPException passes through body parsing untouched and
                    # reaches the one handler above.
                    raise StarletteHTTPException(413, detail)
            return message

        await self.app(scope, limited_receive, send)

    def _too_large_detail(self, is_json: bool = False) -> str:
        if is_json:
            return (f"JSON request body larger than {self.max_json_bytes} bytes "
                    "(LSA_MAX_JSON_BYTES): send a smaller input, or raise the limit")
        return (f"request body larger than {self.max_bytes} bytes (LSA_MAX_UPLOAD_BYTES plus "
                "multipart framing)")
