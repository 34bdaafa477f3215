"""The one error hierarchy of Pipette.

Every error a user can cause carries the *field* that is wrong and the *fix* that would
make it right, so the CLI can print one line and the service can map it to one HTTP
answer (see ``service``). Nothing else in the code raises bare ``ValueError`` at a user.
"""

from __future__ import annotations


class PipetteError(Exception):
    """Base of every error Pipette raises on purpose."""

    #: HTTP status the service answers with for this kind of error.
    http_status: int = 500

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        self.fix = fix

    def __str__(self) -> str:
        head = f"{self.field}: {self.message}" if self.field else self.message
        return f"{head} (fix: {self.fix})" if self.fix else head

    def to_dict(self) -> dict[str, str | None]:
        return {
            "error": type(self).__name__,
            "message": self.message,
            "field": self.field,
            "fix": self.fix,
        }


class SpecError(PipetteError):
    """A model, training, device, cluster or parallel spec is invalid."""

    http_status = 422


class UnknownPresetError(SpecError):
    """A preset name (model, device) is not known."""


class ClusterFileError(SpecError):
    """A cluster file is malformed or inconsistent."""


class InfeasibleError(PipetteError):
    """No candidate satisfies the recipe, or none fits in memory."""

    http_status = 422

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        fix: str | None = None,
        shortfall_bytes: int | None = None,
        reasons: dict[str, int] | None = None,
    ):
        super().__init__(message, field=field, fix=fix)
        self.shortfall_bytes = shortfall_bytes
        self.reasons = dict(reasons or {})


class StoreError(PipetteError):
    """A kept record cannot be read or written (a trial store's file or row): names which, and
    how to repair it."""
