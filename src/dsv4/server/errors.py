"""HTTP errors in OpenAI's JSON shape: `{"error": {"message", "type", "param", "code"}}`, with
OpenAI's `type` values (`invalid_request_error` for 4xx, `server_error` for 5xx) and `code` a
string or null.

Owns `APIError` (raised anywhere in request handling) and the FastAPI exception handlers that turn
it, unknown routes, and stray validation errors into that shape. Status codes: 400 invalid input
(the message names the field), 401 bad or missing API key, 404 unknown model or route, 413 body too
large, 503 overloaded, draining, or the engine is not (or no longer) available.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

# OpenAI's `type` values: the client's exception class comes from the status code
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
          503: "server_error"}
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*)(=| is | has | contains | \+ )")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, object]:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: str | None = None) -> APIError:
    """400; `param` defaults to the field a dsv4 ValueError message starts with
    ("max_tokens=0 is invalid")."""
    return APIError(400, message, param if param is not None else field_of(message))


RETRY_AFTER_S = {"shutting_down": 10, "loading": 5, "queue_full": 1}
"""503s a client should retry (elsewhere, or here later): the `Retry-After` seconds they carry."""


def unavailable(message: str, code: str = "service_unavailable") -> APIError:
    """503; `Retry-After` for the transient codes of `RETRY_AFTER_S`."""
    retry = RETRY_AFTER_S.get(code)
    return APIError(503, message, code=code,
                    headers={"Retry-After": str(retry)} if retry is not None else None)


def field_of(message: str) -> str | None:
    m = _FIELD.match(message)
    return m.group(1) if m else None


def from_validation_error(err: ValidationError) -> APIError:
    """The first pydantic error, as a 400 naming its location ("messages.0.role: Field
    required")."""
    first = err.errors()[0]
    if first["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {first['msg']}", code="invalid_json")
    param = _param_of(first["loc"])
    return APIError(400, f"{param}: {first['msg']}" if param else str(first["msg"]), param=param)


def _param_of(loc: tuple[int | str, ...]) -> str | None:
    """"messages[0].role" from pydantic's ("messages", 0, "role"); union-member tags ("list[int]")
    end it."""
    param = ""
    for part in loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in _TYPE_TAGS:
            param += f".{part}" if param else part
        else:
            break
    return param or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def install_handlers(app: FastAPI, on_error: Callable[[int], None] | None = None) -> None:
    """Answer APIError, unknown routes / methods and validation errors in the OpenAI shape;
    `on_error` gets the status of every APIError (for the rejected-requests metric)."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        if on_error is not None:
            on_error(exc.status)
        return exc.response()

    async def on_http_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(exc.status_code, str(exc.detail)).response()

    async def on_validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _param_of(tuple(x for x in first["loc"] if x != "body"))
        message = f"{param}: {first['msg']}" if param else str(first["msg"])
        return APIError(400, message, param=param).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
