"""HTTP errors of the API: a status, a message that says what to change, optional headers."""

from __future__ import annotations

from fastapi.responses import JSONResponse

RETRY_AFTER_S = "1"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """One error shape for every endpoint, OpenAI's: the native API's clients read
    ``error.message`` and ``error.code``, OpenAI clients the rest too."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


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


def error_response(
    status: int, message: str, headers: dict | None = None, param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)
