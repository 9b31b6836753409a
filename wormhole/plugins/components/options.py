"""Component options: the base model every component's options extend, and the kinds."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

Kind = Literal[
    "source", "sink", "filter", "transport", "position_mapper", "datamarker_store", "registry"
]
KINDS: tuple[Kind, ...] = (
    "source",
    "sink",
    "filter",
    "transport",
    "position_mapper",
    "datamarker_store",
    "registry",
)


MAX_DURATION_S = 365 * 86_400
"""The longest duration an option may hold: one year."""


class Options(BaseModel):
    """Base for component options: unknown keys are errors, so typos never pass silently.

    Numbers must be finite, and a duration (an option named ``*_s``, in seconds, or ``*_ms``,
    in milliseconds) at most a year: longer ones do not fit the timeouts they feed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    def describes_updates(self) -> bool:
        """Whether this use of the component needs updates that describe themselves:
        ``Update.columns`` and ``Update.details`` (Debezium's format does). The publisher
        asks its source for them (``SourceContext.describe_updates``) when the transport's
        options or any application's sink options say so at the start of a run."""
        return False

    def marks_transactions(self) -> bool:
        """Whether this use of the component needs each update marked with its
        transaction (``Update.transaction``: Debezium's transaction metadata). The
        publisher asks its source for them (``SourceContext.transaction_metadata``) as for
        :meth:`describes_updates`."""
        return False

    @field_validator("*")
    @classmethod
    def _duration_fits(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        unit = 1.0 if name.endswith("_s") else 0.001 if name.endswith("_ms") else None
        if (
            unit is not None
            and isinstance(value, int | float)
            and not isinstance(value, bool)
            and value * unit > MAX_DURATION_S
        ):
            raise ValueError(f"must be at most {round(MAX_DURATION_S / unit):,} (a year)")
        return value


class NoOptions(Options):
    """For components that take no options."""
