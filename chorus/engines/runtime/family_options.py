"""A model family's request fields: each family declares them once, as a `FamilyOptions` model (names, types,
strictness, descriptions) beside its serving code; the OpenAI request models take every declared field
(`chorus.engines.families.options.FamilyFields`), and the family's observer checks the values against the model
it serves. A field sent to a model of another family is a 400 that names the field and its family."""

from __future__ import annotations

import importlib
import inspect
from typing import Any, ClassVar

from pydantic import BaseModel

from chorus.errors import InvalidRequest

#: every declared field -> the family that takes it (filled as the families' option models are defined)
FIELD_FAMILY: dict[str, str] = {}
#: where every family's options are imported (lazily, as the registries: this layer sits below the families)
DECLARATIONS = "chorus.engines.families.options"


class FamilyOptions(BaseModel):
    """Subclass per family with ``family = "Name"`` and one optional field per request option."""

    family: ClassVar[str] = ""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        if "family" not in cls.__dict__:  # a composition of families (FamilyFields), not a family
            return
        for name in inspect.get_annotations(cls):
            if name in FIELD_FAMILY and FIELD_FAMILY[name] != cls.family:
                raise TypeError(f"request field {name!r} is declared by {FIELD_FAMILY[name]} and {cls.family}")
            FIELD_FAMILY[name] = cls.family

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields)


def refuse_foreign(options: dict[str, Any], takes: tuple[str, ...], model: str) -> None:
    """400 naming the first of ``options`` that ``model`` does not take (``takes``) and the family that does."""
    if set(options) - set(takes) and not FIELD_FAMILY:
        importlib.import_module(DECLARATIONS)
    for name in sorted(set(options) - set(takes)):
        family = FIELD_FAMILY.get(name)
        raise InvalidRequest(f"'{name}' applies to {family + ' models' if family else 'no model'} only; {model!r} "
                             f"is not one.", param=name)
