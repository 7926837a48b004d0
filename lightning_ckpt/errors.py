"""One exception family for everything lightning_ckpt refuses, and one warning family for what it goes on after.
Subclasses let callers (the tuner, the CLI) tell a bad plan from a bad argument without parsing strings."""

from __future__ import annotations

__all__ = [
    "ApplyError",
    "ConfigurationError",
    "DiscoveryError",
    "InfeasibleBudgetError",
    "LightningCkptError",
    "LightningCkptWarning",
    "PlanError",
    "PlanFileChangedError",
    "StalePlanError",
    "StalePlanWarning",
    "TrialsFailedError",
    "UnsupportedVersionError",
]


class LightningCkptError(Exception):
    """Base class of every error raised by lightning_ckpt."""


class DiscoveryError(LightningCkptError):
    """The model's repeated layer stack could not be found, or the user's override matched nothing."""


class PlanError(LightningCkptError):
    """A plan is malformed, from an unknown schema, or does not fit the model it is applied to."""


class PlanFileChangedError(PlanError):
    """A plan file changed on disk since this process last read or wrote it (another run saved to it), so a save
    that would have overwritten it wrote nothing.

    ``current`` is the plan the file holds now (None when it is not a readable plan); ``held`` says so in words.
    """

    def __init__(self, message: str, *, path: str, current: object = None, held: str = "") -> None:
        super().__init__(message)
        self.path, self.current, self.held = path, current, held


class StalePlanError(PlanError):
    """A plan was tuned for a different model (fingerprint mismatch)."""


class ApplyError(LightningCkptError):
    """A plan could not be applied (or removed) safely on this model."""


class ConfigurationError(LightningCkptError, ValueError):
    """An argument has an invalid value; raised at construction time, before any work is done."""


class InfeasibleBudgetError(LightningCkptError):
    """No plan can fit: none fits the memory budget and the caller asked to raise rather than fall back, or a pass that
    needs no more memory than the lowest-memory plan ran out of it (``allocator``: the allocator's figures then)."""

    def __init__(self, message: str, *, allocator: dict | None = None) -> None:
        super().__init__(message)
        self.allocator = dict(allocator or {})


class UnsupportedVersionError(LightningCkptError, RuntimeError):
    """A feature needs a newer torch than the one installed; raised where the feature is used, never at import."""


class TrialsFailedError(LightningCkptError):
    """Every trial that ran failed with an error: no plan was ever seen to work, so none is applied or saved."""


class LightningCkptWarning(UserWarning):
    """Base class of the warnings lightning_ckpt gives and goes on (``warnings.filterwarnings("ignore",
    category=LightningCkptWarning)`` silences them all)."""


class StalePlanWarning(LightningCkptWarning):
    """A plan (a file, or ``plan=``) no longer fits this model or run, and the search runs again instead
    (``guard={'on_stale_plan': 'retune'}``). Filter it by this category, or pass ``guard={'on_stale_plan': 'raise'}`` to make it an error."""
