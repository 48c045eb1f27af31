"""Every model family's request fields in one model, for the OpenAI request models to inherit: the wire format
is the families' own declarations (`MoDrOptions`, `ReasonFormerOptions`), validated where they are declared.
A new family with request fields adds its options class here."""

from __future__ import annotations

from typing import Any

from chorus.engines.families.modr.serving import MoDrOptions
from chorus.engines.families.reasonformer.serving import ReasonFormerOptions


class FamilyFields(MoDrOptions, ReasonFormerOptions):
    """The union of the families' request fields."""

    @property
    def family_options(self) -> dict[str, Any]:
        """The family fields the request set (for the engine's observer to check and use)."""
        return {name: v for name in FamilyFields.model_fields if (v := getattr(self, name)) is not None}
