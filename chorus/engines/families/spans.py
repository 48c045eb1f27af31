"""What MoDr's and ReasonFormer's configs share, both built over a frozen Llama-architecture base split into three
spans of layers (MoDr: prelude / core / coda; ReasonFormer: representation / block / coda) with LoRA on the middle
one: the checks of the spans and of the LoRA targets. (Their models share `OverBaseModel` and their storage
`OverBase`, both in checkpoint.py.)"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from chorus.errors import BuildError

#: the attention projections a LoRA may sit on
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def check_spans(spans: dict[str, tuple[int, int]], n_layers: int) -> None:
    """Each span a non-empty range inside the base's ``n_layers``, in the dict's order without overlap."""
    for name, (a, b) in spans.items():
        if not (0 <= a < b <= n_layers):
            raise BuildError(f"{name} range [{a}, {b}) is not a non-empty range inside the base's {n_layers} layers")
    ordered = list(spans.values())
    if any(earlier[1] > later[0] for earlier, later in itertools.pairwise(ordered)):
        raise BuildError(f"layer ranges must be in order {' < '.join(spans)} without overlap (got "
                         f"{', '.join(str(list(r)) for r in ordered)})")


def check_targets(targets: tuple[str, ...] | list[str]) -> None:
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise BuildError(f"LoRA targets must be among {', '.join(TARGETS)} (got {list(targets)})")


def split_options(options: dict[str, Any], spans: tuple[str, str, str], family: str,
                  known: Iterable[str]) -> tuple[dict[str, tuple[int, int]], dict[str, Any]]:
    """A config's ``derive.options``: the three spans (all of them, or none for the default split) and the rest,
    every name of the rest one of ``known`` (the config's fields)."""
    opts = dict(options)
    ranges = {k: tuple(opts.pop(k)) for k in spans if k in opts}
    if ranges and len(ranges) != 3:
        raise BuildError(f"give all three of {spans[0]}, {spans[1]} and {spans[2]} (or none for the default split)")
    fields = list(known)
    unknown = sorted(set(opts) - set(fields))
    if unknown:
        raise BuildError(f"unknown {family} settings {unknown}; known: {', '.join(fields)}")
    return ranges, opts
