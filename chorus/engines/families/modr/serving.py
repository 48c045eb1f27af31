"""MoDr in the batching engine: request options (``recurrence``, ``exit``) and the routing observer."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from chorus.engines.families.modr.config import MoDrConfig
from chorus.engines.families.modr.model import MoDrModel, RowControl
from chorus.engines.runtime.family_options import FamilyOptions, refuse_foreign
from chorus.engines.runtime.kv_cache import grow_steps, step_slots
from chorus.engines.runtime.metric import Metric
from chorus.engines.runtime.observer import FamilyObserver


class MoDrOptions(FamilyOptions):
    """MoDr's request fields (extensions to OpenAI's requests); their values are checked by `check_options`."""

    family = "MoDr"
    recurrence: int | None = Field(default=None, description="extension, MoDr models: recurrence steps per token")
    exit: dict[str, Any] | None = Field(
        default=None, description='extension, MoDr models: adaptive exit, e.g. {"kl": 5e-4}')


def check_options(options: dict[str, Any], cfg: MoDrConfig, model: str = "this model") -> None:
    """A request's ``recurrence`` and ``exit`` (400 with the parameter named when wrong)."""
    from chorus.errors import InvalidRequest

    refuse_foreign(options, MoDrOptions.names(), model)
    rec = options.get("recurrence")
    if rec is not None and (isinstance(rec, bool) or not isinstance(rec, int) or not 1 <= rec <= cfg.max_recurrence):
        raise InvalidRequest(f"'recurrence' must be an integer from 1 to {cfg.max_recurrence} for this model.",
                             param="recurrence")
    ex = options.get("exit")
    if ex is not None:
        kl = ex.get("kl") if isinstance(ex, dict) else None
        if not isinstance(ex, dict) or set(ex) - {"kl"} or isinstance(kl, bool) or not isinstance(kl, (int, float)) \
                or not kl > 0:
            raise InvalidRequest("'exit' must be an object like {\"kl\": 5e-4}: stop recurring a token once the KL "
                                 "divergence between successive next-token distributions is below kl (> 0).",
                                 param="exit")


class RoutingObserver(FamilyObserver):
    """The batching engine's `FamilyObserver` for MoDr: hands each row its recurrence / exit before a
    forward, and records the branch per step and the steps used per token afterwards (``session.family``),
    plus totals since start-up for Prometheus (a collapsed router shows as one branch taking everything)."""

    reuses_prefixes = False  # a slot per recurrence step, and a request's recurrence changes what is cached

    def __init__(self, model: MoDrModel) -> None:
        self.model = model
        self.branch_totals = [0] * model.cfg.branches
        self.steps_total = 0
        self.tokens_total = 0

    def check_options(self, options: dict[str, Any], model: str) -> None:
        check_options(options, self.model.cfg, model)

    def match_caches(self, a: list[Any], b: list[Any]) -> tuple[list[Any], list[Any]]:
        """Two caches with different numbers of step slots: extend the shorter with its latest step."""
        m = self.model
        fixed, core = len(m.prelude) + len(m.coda), len(m.core)
        steps = max(step_slots(a, fixed, core), step_slots(b, fixed, core))
        return grow_steps(list(a), fixed, core, steps), grow_steps(list(b), fixed, core, steps)

    def control(self, options: dict[str, Any]) -> RowControl:
        ex = options.get("exit") or {}
        return RowControl(int(options.get("recurrence") or self.model.cfg.recurrence), ex.get("kl"))

    def before(self, rows: list[Any]) -> None:
        self.model.controls = [self.control(s.options) if s is not None else None for s in rows]

    def after(self, rows: list[Any], lens: list[int], width: int) -> None:
        for s, rep, n in zip(rows, self.model.reports, lens):
            if s is None or n == 0:
                continue
            if s.family is None:
                s.family = {"prompt": [], "tokens": []}
            for b in rep.branches:
                self.branch_totals[b] += 1
            if s.joined:
                s.family["tokens"].append(rep)
                self.steps_total += rep.steps
                self.tokens_total += 1
            else:
                s.family["prompt"].append(rep)
        self.model.controls = None

    def trace(self, sessions: list[Any]) -> dict[str, Any]:
        fams = [s.family or {"prompt": [], "tokens": []} for s in sessions]
        prompt = fams[0]["prompt"] if fams else []
        usage = [0] * self.model.cfg.branches
        for f in fams:
            for rep in [*f["prompt"], *f["tokens"]]:
                for b in rep.branches:
                    usage[b] += 1
        ctl = self.control(sessions[0].options) if sessions else RowControl(self.model.cfg.recurrence)
        return {"modr": {
            "recurrence": ctl.recurrence, "exit_kl": ctl.exit_kl,
            "prompt": [{"branches": r.branches, "steps": r.steps} for r in prompt],
            "choices": [{"branches": [r.branches for r in f["tokens"]], "steps": [r.steps for r in f["tokens"]]}
                        for f in fams],
            "branch_usage": usage,
        }}

    def metrics(self) -> list[Metric]:
        return [
            (
                "chorus_modr_branch_selections_total",
                "Routing decisions per MoDr branch (one per token or prompt per step)",
                ["branch"],
                [([str(i)], float(c)) for i, c in enumerate(self.branch_totals)],
            ),
            (
                "chorus_modr_recurrence_steps_total",
                "Recurrence steps run for decoded tokens",
                [],
                [([], float(self.steps_total))],
            ),
            (
                "chorus_modr_decoded_tokens_total",
                "Tokens decoded (steps / tokens = mean recurrence)",
                [],
                [([], float(self.tokens_total))],
            ),
        ]
