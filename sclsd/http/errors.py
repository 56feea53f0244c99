"""The one error type of the HTTP front end: answered as OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad(param: str | None, message: str, code: str = "invalid_parameter") -> ApiError:
    """A 400 naming ``param``."""
    return ApiError(400, message, param, code)


def unsupported(param: str, why: str) -> ApiError:
    """A 400 for a parameter this server knows but cannot serve, saying why."""
    return ApiError(400, f"{param}: {why}", param, "unsupported_parameter")
