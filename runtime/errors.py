"""Errors a user can act on. Each renders as one line naming what is wrong and where."""


class CadenceError(Exception):
    """Base class: the message is a complete one-line explanation."""


class CheckpointError(CadenceError):
    """A checkpoint directory, file, tensor or config field is missing or malformed."""


class CapacityError(CadenceError):
    """The engine has no room for another sequence (all KV rows are taken)."""


class RequestError(CadenceError):
    """A request's parameters are invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
