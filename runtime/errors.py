"""Errors a user can act on. Each renders as one line naming what is wrong and where."""


class CadenceError(Exception):
    """Base class: the message is a complete one-line explanation."""


# A message quoting a value from a file at length (a config field holding a list of
# 100,000 numbers made one of 300 KB) keeps its start, which names the file and the
# field, and its end, which says what would do.
MAX_CHECKPOINT_MESSAGE = 2000


class CheckpointError(CadenceError):
    """A checkpoint directory, file, tensor or config field is missing or malformed."""

    def __init__(self, message: str):
        if len(message) > MAX_CHECKPOINT_MESSAGE:
            cut = len(message) - MAX_CHECKPOINT_MESSAGE
            head, tail = message[: MAX_CHECKPOINT_MESSAGE - 500], message[-500:]
            message = f"{head}... ({cut} characters left out) ...{tail}"
        super().__init__(message)


class CapacityError(CadenceError):
    """The engine has no room for another sequence (all KV rows are taken)."""


class RequestError(CadenceError):
    """A request's parameters are invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
