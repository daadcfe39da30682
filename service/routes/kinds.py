"""The deprecation notice of a request body without `kind` (api_schemas.requests: read by the
old one-object schema, for one minor version)."""

from __future__ import annotations

from starlette.responses import Response


def mark_inferred(response: Response, endpoint: str, inferred: str | None) -> Response:
    """`response` with a `Deprecation` header (and a `Warning` saying what to send) when the
    request's kind was inferred; as is otherwise."""
    if inferred is not None:
        response.headers["Deprecation"] = "true"
        response.headers["Warning"] = (
            f'299 lsa "{endpoint} without kind is deprecated: read as kind={inferred}; send '
            f'kind (bodies without it are taken until the next minor version)"')
    return response
