"""HTTP errors of the API: a status, a message that says what to change, optional headers."""

from __future__ import annotations

from fastapi.responses import JSONResponse

RETRY_AFTER_S = "1"


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}

    @staticmethod
    def unavailable(message: str) -> ApiError:
        """503 with Retry-After: starting, draining or full; a retry may succeed."""
        return ApiError(503, message, {"Retry-After": RETRY_AFTER_S})


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(
        {"error": {"code": status, "message": message}}, status_code=status, headers=headers
    )
