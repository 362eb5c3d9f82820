"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

400 for bad parameters (naming the parameter in `param` and in the message), 401 for a
missing or wrong API key (`--api-key`, code "invalid_api_key" as OpenAI answers), 404 for an
unknown model or path, 413 for a body over the limit, 429 where gRPC answers
RESOURCE_EXHAUSTED (admission control), 503 where it answers UNAVAILABLE (starting,
draining, a process died), 500 for anything else.
"""
from __future__ import annotations

from typing import Any

from tandem_serve.frontend.engine_client import EngineError
from tandem_serve.frontend.validation import ValidationError

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
         405: "invalid_request_error",
         413: "invalid_request_error", 429: "rate_limit_error",
         503: "service_unavailable_error", 500: "internal_server_error"}
# An engine error's status: INVALID_ARGUMENT and UNIMPLEMENTED come from compiling a
# constraint (guided decoding), which names its parameter first in the message.
CODES = {"RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503, "INVALID_ARGUMENT": 400,
         "UNIMPLEMENTED": 400}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    @classmethod
    def bad_parameter(cls, exc: ValidationError) -> ApiError:
        return cls(400, str(exc), exc.field, "invalid_parameter")

    @classmethod
    def from_engine(cls, exc: EngineError, param: str | None = None) -> ApiError:
        status = CODES.get(exc.code, 500)
        code = {429: "rate_limit_exceeded", 503: "service_unavailable",
                400: "invalid_parameter"}.get(status, "internal_error")
        return cls(status, str(exc), param if status == 400 else None, code)
