"""ReasonFormer in the batching engine: request options (``max_steps``, ``stop_threshold``) and the observer
that keeps each sequence's decision (made on its prompt) for its decoded tokens."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from chorus.engines.families.reasonformer.config import ReasonFormerConfig
from chorus.engines.families.reasonformer.model import Decision, ReasonFormerModel, RowControl
from chorus.engines.runtime.family_options import FamilyOptions, refuse_foreign
from chorus.engines.runtime.kv_cache import grow_steps, step_slots
from chorus.engines.runtime.metric import Metric
from chorus.engines.runtime.observer import FamilyObserver


class ReasonFormerOptions(FamilyOptions):
    """ReasonFormer's request fields; strict, so `true` or "2" is a 400, never read as a cap of 1 or 2. Their
    values are checked against the served model by `check_options`."""

    family = "ReasonFormer"
    max_steps: int | None = Field(default=None, strict=True,
                                  description="extension, ReasonFormer models: reasoning steps cap")
    stop_threshold: float | None = Field(
        default=None, strict=True,
        description="extension, ReasonFormer models: a step whose stop gate is below it ends the cascade")


OPTIONS = ReasonFormerOptions.names()


def check_options(options: dict[str, Any], cfg: ReasonFormerConfig, model: str = "this model") -> None:
    """A request's ``max_steps`` and ``stop_threshold`` (400 with the parameter named when wrong)."""
    from chorus.errors import InvalidRequest

    refuse_foreign(options, OPTIONS, model)
    steps = options.get("max_steps")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= cfg.max_steps):
        raise InvalidRequest(f"'max_steps' must be an integer from 1 to {cfg.max_steps} (the reasoning steps this "
                             "model was built with).", param="max_steps")
    thr = options.get("stop_threshold")
    if thr is not None and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or not 0.0 <= thr <= 1.0):
        raise InvalidRequest("'stop_threshold' must be a number in [0, 1]: a reasoning step whose stop gate is below "
                             "it ends the cascade (0: never stop early).", param="stop_threshold")


class ReasonObserver(FamilyObserver):
    """The batching engine's `FamilyObserver` for ReasonFormer: a session's first forward (its prompt)
    decides the skills per step and the depth; the observer keeps that decision (``session.family``) and
    hands it back for every later forward of the sequence, and counts skill weights and steps since start-up."""

    decides_on_prompt = True
    reuses_prefixes = False  # its skill choice reads the whole prompt, and its cache has a slot per step

    def __init__(self, model: ReasonFormerModel) -> None:
        self.model = model
        self.weight_sums = [0.0] * model.cfg.n_skills
        self.steps_total = 0
        self.sequences = 0

    def check_options(self, options: dict[str, Any], model: str) -> None:
        check_options(options, self.model.cfg, model)

    def control(self, options: dict[str, Any], decision: Decision | None = None) -> RowControl:
        cfg = self.model.cfg
        thr = options.get("stop_threshold")
        return RowControl(int(options.get("max_steps") or cfg.max_steps),
                          float(cfg.stop_threshold if thr is None else thr), decision)

    def before(self, rows: list[Any]) -> None:
        self.model.controls = [self.control(s.options, s.family) if s is not None else None for s in rows]

    def after(self, rows: list[Any], lens: list[int], width: int) -> None:
        for s, decision, n in zip(rows, self.model.reports, lens):
            if s is None or n == 0 or s.family is not None:
                continue
            s.family = decision
            self.sequences += 1
            self.steps_total += decision.depth
            for skills, weights in zip(decision.skills, decision.weights):
                for j, w in zip(skills, weights):
                    self.weight_sums[j] += w
        self.model.controls = None

    def joined(self, sessions: list[Any]) -> None:
        for s in sessions[1:]:  # the n choices of one prompt share its prefill, hence its decision
            s.family = sessions[0].family

    def match_caches(self, a: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
        """Two caches with different numbers of step slots: extend the shorter with its latest step."""
        m = self.model
        fixed, core = len(m.representation) + len(m.coda), m.cfg.k * len(m.block)
        steps = max(step_slots(a, fixed, core), step_slots(b, fixed, core))
        return grow_steps(list(a), fixed, core, steps), grow_steps(list(b), fixed, core, steps)

    def describe(self, d: Decision | None) -> dict[str, Any]:
        names = self.model.cfg.skills
        d = d or Decision()
        return {"depth": d.depth, "stop_gate": d.stop_gate,
                "steps": [{"skills": {names[j]: round(w, 4) for j, w in zip(sk, ws)}, "gate": g,
                           "coef": round(c, 4)} for sk, ws, g, c in zip(d.skills, d.weights, d.gates, d.coefs)]}

    def trace(self, sessions: list[Any]) -> dict[str, Any]:
        ctl = self.control(sessions[0].options if sessions else {})
        return {"reasonformer": {"max_steps": ctl.max_steps, "stop_threshold": ctl.stop_threshold,
                                 "choices": [self.describe(s.family) for s in sessions]}}

    def metrics(self) -> list[Metric]:
        return [
            ("chorus_reasonformer_skill_weight_sum", "Router weight given to each skill, summed over the steps of "
             "every sequence served (weight / sequences = mean per sequence)", ["skill"],
             [([name], round(w, 6)) for name, w in zip(self.model.cfg.skills, self.weight_sums)]),
            ("chorus_reasonformer_steps_total", "Reasoning steps run, one count per step per sequence", [],
             [([], float(self.steps_total))]),
            ("chorus_reasonformer_sequences_total", "Sequences routed (steps_total / sequences_total = mean depth)",
             [], [([], float(self.sequences))]),
        ]
