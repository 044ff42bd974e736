"""API errors rendered as ``meta/v1 Status`` objects, with the reasons and codes of the real
server (``k8s.io/apimachinery/pkg/api/errors``)."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An error answered to the client as a ``Status`` with ``status: Failure``."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details

    def status(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        }
        if self.details is not None:
            body["details"] = self.details
        return body


def qualified(group: str, plural: str) -> str:
    """``deployments.apps``, or ``configmaps`` for the core group, as the server names them."""
    return f"{plural}.{group}" if group else plural


def _details(group: str, plural: str, name: str | None) -> dict[str, Any]:
    details: dict[str, Any] = {"kind": plural}
    if group:
        details["group"] = group
    if name:
        details["name"] = name
    return details


def not_found(group: str, plural: str, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{qualified(group, plural)} "{name}" not found',
        _details(group, plural, name),
    )


def no_route() -> ApiError:
    return ApiError(404, "NotFound", "the server could not find the requested resource", {})


def already_exists(group: str, plural: str, name: str) -> ApiError:
    return ApiError(
        409,
        "AlreadyExists",
        f'{qualified(group, plural)} "{name}" already exists',
        _details(group, plural, name),
    )


def conflict(group: str, plural: str, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {qualified(group, plural)} "{name}": {why}',
        _details(group, plural, name),
    )


def stale(group: str, plural: str, name: str) -> ApiError:
    return conflict(
        group,
        plural,
        name,
        "the object has been modified; please apply your changes to the latest version "
        "and try again",
    )


def invalid(group: str, plural: str, name: str, message: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{qualified(group, plural)} "{name}" is invalid: {message}',
        _details(group, plural, name),
    )


def unprocessable(message: str) -> ApiError:
    """What the real server answers when a JSON patch cannot be applied (incl. ``test``)."""
    return ApiError(422, "UnprocessableEntity", message)


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def service_unavailable(message: str) -> ApiError:
    return ApiError(503, "ServiceUnavailable", message)


def forbidden(group: str, plural: str, name: str, message: str) -> ApiError:
    return ApiError(
        403,
        "Forbidden",
        f'{qualified(group, plural)} "{name}" is forbidden: {message}',
        _details(group, plural, name),
    )


def method_not_allowed(method: str) -> ApiError:
    return ApiError(
        405,
        "MethodNotAllowed",
        f"the server does not allow this method on the requested resource ({method})",
    )


def unsupported_media_type(content_type: str) -> ApiError:
    return ApiError(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types include: "
        f"application/json-patch+json, application/merge-patch+json, "
        f'application/apply-patch+yaml ("{content_type}")',
    )


def gone(requested: int, oldest: int) -> ApiError:
    return ApiError(410, "Expired", f"too old resource version: {requested} ({oldest})")


def json_type(value: object) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if isinstance(value, dict):
        return "object"
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"


def not_an_object(what: str, value: object) -> ApiError:
    return bad_request(f"{what} must be a JSON object, not a JSON {json_type(value)}")
