"""Errors a client can fix: each names what is wrong and where (row, column, field, limit).

Every 4xx of the HTTP API has one shape, the OpenAI style: `{"error": {"message", "type", "param",
"code"}}` (`param`: the field or column at fault, or null), plus `row`, `column` and `field` where they
apply. Text the client sent is never echoed at length: `clip` shortens it."""

from __future__ import annotations

from typing import Any

MAX_ECHO_CHARS = 100

ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}
ERROR_CODES = {
    400: "bad_request",
    401: "invalid_api_key",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    409: "conflict",
    413: "upload_too_large",
    415: "unsupported_media_type",
    422: "invalid_value",
    503: "unavailable",
}


def clip(text: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` (as str) cut to `limit` characters, with how much was left out."""
    text = str(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text) - limit} more characters)"


def clip_repr(text: Any, limit: int = MAX_ECHO_CHARS) -> str:
    """repr() of a value the client sent, cut like `clip`."""
    return clip(repr(text), limit)


def error_body(
    status_code: int,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    error: dict[str, Any] = {
        "message": message,
        "type": ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "api_error"),
        "param": param,
        "code": code or ERROR_CODES.get(status_code, "error"),
    }
    error.update({name: value for name, value in extra.items() if value is not None})
    return {"error": error}


class InputError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status_code: int = 422,
        row: int | None = None,
        column: str | None = None,
        field: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.row = row
        self.column = column
        self.field = field
        self.code = code

    def as_dict(self) -> dict[str, Any]:
        return error_body(
            self.status_code,
            self.message,
            param=self.field or self.column,
            code=self.code,
            row=self.row,
            column=self.column,
            field=self.field,
        )["error"]


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass
