"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with the HTTP status."""
from __future__ import annotations

import json

from fastapi.responses import JSONResponse

from pagedserve.server.protocol import ErrorInfo, ErrorResponse

# OpenAI's error types by status; anything else 5xx is a server error.
_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
          405: "invalid_request_error", 503: "service_unavailable"}


class OpenAIError(Exception):
    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | int | None = None, type: str | None = None) -> None:
        # A message may quote request text; a lone surrogate in it would make the JSON body unencodable.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "server_error" if status_code >= 500
                                       else "invalid_request_error")

    @classmethod
    def in_band(cls, exc: Exception) -> OpenAIError:
        # An error after a stream started: 503 when the engine stopped, 400 when the request's own parameters
        # failed it (RequestConstraintError is a ValueError), else 500.
        from pagedserve.messages import EngineClosedError

        status = 503 if isinstance(exc, EngineClosedError) else 400 if isinstance(exc, ValueError) else 500
        return cls(str(exc), status)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status_code)

    def sse_payload(self) -> str:
        # Mid-stream errors travel as one more SSE event; the openai client raises APIError on it.
        return f"data: {json.dumps(self.body().model_dump())}\n\n"
