"""The HTTP API's errors in OpenAI's shape (`openai_compat.ApiError`): the handlers of
the app's exceptions (a refused request, a body that does not validate, Starlette's own
errors, a client gone before its answer) and the response every refusal is.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from .openai_compat import ApiError, bad_request

CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never received


class ClientGone(Exception):
    """The HTTP client disconnected before the response was ready."""


def add_error_handlers(app: FastAPI) -> None:
    """Every error of `app` answered in OpenAI's shape."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(ClientGone, _client_gone)


def error_response(e: ApiError, close: bool = False) -> JSONResponse:
    """`close`: the body was not read, so the connection ends with this response."""
    headers = {"Retry-After": "1"} if e.status in (429, 503) else {}
    if close:
        headers["Connection"] = "close"
    return JSONResponse(e.body(), status_code=e.status, headers=headers or None)


async def _api_error(request: Request, e: ApiError) -> JSONResponse:
    return error_response(e)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    """A body that does not parse or fit the schema: 400 (FastAPI's default is 422)."""
    errors = e.errors()
    first = errors[0] if errors else {}
    loc = [p for p in first.get("loc", ()) if p != "body"]
    field = str(loc[0]) if loc else None
    if first.get("type") == "json_invalid":
        message = first.get("msg", "invalid request")
        message = f"the body is not valid JSON ({first.get('ctx', {}).get('error', message)})"
        return error_response(bad_request(message))
    # A union (prompt, stop, content) fails once per accepted shape: the error of the
    # shape the value has (a bound, bad text) says more than "should be a list".
    same = [x for x in errors if [p for p in x.get("loc", ()) if p != "body"][:1] == loc[:1]]
    best = next((x for x in same if not x.get("type", "").endswith(_SHAPE_ERRORS)), first)
    message = best.get("msg", "invalid request").removeprefix("Value error, ")
    if len(same) > 1 and best.get("type", "").endswith(_SHAPE_ERRORS):
        message = f"{message}, nor any other accepted shape"
    return error_response(bad_request(f"{field}: {message}" if field else message, field))


# pydantic error types that only say the value has another shape than one union member.
_SHAPE_ERRORS = ("_type", "literal_error", "union_tag_invalid")


async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
    if e.status_code == 400:  # FastAPI's body parse failure (JSON nested too deeply)
        return error_response(bad_request(f"the body could not be parsed: {e.detail} "
                                           "(JSON nested too deeply?)"))  # fmt: skip
    code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
    return error_response(ApiError(e.status_code, str(e.detail), code))


async def _client_gone(request: Request, e: ClientGone) -> Response:
    return Response(status_code=CLIENT_CLOSED)
