"""Validation errors that name the offending field."""


class InvalidArgument(ValueError):
    """A user-supplied value is out of range; `field` names it (services map it to INVALID_ARGUMENT)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message


def check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidArgument(field, message)


class StartupError(RuntimeError):
    """The engine cannot run here as configured (found at start-up, said in one sentence)."""


class NotFound(InvalidArgument):
    """A named thing (a LoRA adapter) that is not here; services map it to NOT_FOUND."""


class InUse(InvalidArgument):
    """A change refused because requests still use what it would remove (FAILED_PRECONDITION)."""


class ImagesNotSent(RuntimeError):
    """A request's images came as their spans only (a decode's, from its prefill's KV handle) and
    its KV over one of them must be computed here (its load failed, or it was preempted): it
    must come again with its images (services: FAILURE_REASON_IMAGES_NOT_SENT)."""
