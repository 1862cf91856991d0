"""Errors a client can fix: each names what is wrong and where (row, column, field, limit)."""

from __future__ import annotations

from typing import Any


class InputError(Exception):
    def __init__(
        self,
        message: str,
        *,
        status_code: int = 422,
        row: int | None = None,
        column: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.row = row
        self.column = column
        self.field = field

    def as_dict(self) -> dict[str, Any]:
        detail: dict[str, Any] = {"message": self.message}
        for name in ("row", "column", "field"):
            if getattr(self, name) is not None:
                detail[name] = getattr(self, name)
        return detail


class NotFound(Exception):
    pass


class Conflict(Exception):
    pass
