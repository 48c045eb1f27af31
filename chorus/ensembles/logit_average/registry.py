"""The parts of ``logit_average``, as lazily imported ``"module:Class"`` strings: the alignments (``align:``) and the
modes of one shared vocabulary (``mode:``). The strategy, its parameters and the engine find them here, never by
testing a name. Adding a mode: a session class (a `stepping.MemberSessions`, with its ``options`` and ``count``)
and one line in `MODES`; an alignment: an `Aligned` class (shared_vocab.py is the example) and one line in
`ALIGNS`."""

from __future__ import annotations

from typing import Any

from chorus.lazy import load

ALIGNS: dict[str, str] = {
    "vocab": "chorus.ensembles.logit_average.shared_vocab:LogitAverage",
    "topk_union": "chorus.ensembles.logit_average.topk_union:TopkUnion",
}
MODES: dict[str, str] = {
    "full": "chorus.ensembles.logit_average.full:AveragedSession",
    "selective": "chorus.ensembles.logit_average.selective:SelectiveSession",
    "speculative": "chorus.ensembles.logit_average.speculative:SpeculativeSession",
}


def _load(table: dict[str, str], name: str, what: str) -> Any:
    target = table.get(name)
    if target is None:
        raise ValueError(f"'{what}' must be one of {', '.join(table)}")
    return load(target)


def align_class(name: str) -> Any:
    return _load(ALIGNS, name, "align")


def mode_class(name: str) -> Any:
    return _load(MODES, name, "mode")


def option_modes() -> dict[str, tuple[str, ...]]:
    """Each mode-specific option and the modes it applies to (given for another mode: 400, never ignored)."""
    out: dict[str, tuple[str, ...]] = {}
    for mode in MODES:
        for option in mode_class(mode).options:
            out[option] = (*out.get(option, ()), mode)
    return out
