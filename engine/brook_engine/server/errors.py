"""Errors in the OpenAI shape: ``{"error": {"message", "type", "param", "code"}}``.

Status codes: 400 invalid request (the field in ``param``), 401 API key missing or wrong,
404 unknown model or path, 405 wrong method, 408 body too slow to arrive, 413 body too large,
429 waiting queue full, 500 engine failure, 503 not ready, draining or at the request limit.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(self.status, "invalid_request_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def invalid(message: str, param: str | None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def nested_too_deeply() -> APIError:
    return invalid(
        "the body is nested too deeply to read (arrays and objects inside one another "
        "hundreds of levels down); flatten it",
        None,
        code="invalid_json",
    )


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="unavailable", headers={"Retry-After": "1"})


def field_path(loc: tuple[int | str, ...]) -> str:
    """Pydantic's location as the client wrote it: ``messages[0].content``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in ("str", "int", "list[int]", "list[str]", "list[list[int]]") or "[" in part:
            continue  # the union member pydantic tried, not a field
        else:
            path += f".{part}" if path else part
    return path


def from_validation_error(exc: ValidationError) -> APIError:
    """The first problem decides ``param``; the message lists all of them (a few)."""
    errors = exc.errors()
    problems = []
    for error in errors[:5]:
        where = field_path(tuple(error["loc"]))
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown field; remove it"
        elif error["type"] == "missing":
            message = "required field is missing"
        problems.append(f"{where}: {message}" if where else message)
    first = field_path(tuple(errors[0]["loc"])) if errors else None
    return invalid("; ".join(problems), first or None)
