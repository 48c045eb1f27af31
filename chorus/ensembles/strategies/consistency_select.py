"""``consistency_select``: answer with the member whose own samples agree most (SLM-MUX, Wang et al. 2025).

Each member draws ``samples`` replies (with `answer_vote`'s sampling: ``answer``, ``batch``, ``temperature``,
``stop``); a member's confidence is its agreement: the share of its samples that give its own majority answer
(`votes.agreement`; a sample without an answer counts against it). The member with the highest agreement
answers with its majority answer (the whole text of that answer's most likely sample). Ties go to the member with
the higher ``accuracy`` (a prior per member, e.g. its accuracy on a validation split: `chorus bench answers`
prints it from the train split), then to the earlier member. Members do not vote together: a weak member's
agreeing samples cannot outvote a stronger member, which is why the paper finds it beats plain voting when the
members differ in accuracy.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from pydantic import Field

from chorus.engines.core.base import Delta
from chorus.ensembles.answers.kinds import answer_kind
from chorus.ensembles.answers.votes import agreement, ranked_samples, settled, tally
from chorus.ensembles.base import Budget, Strategy
from chorus.ensembles.call import Call, Member, gather
from chorus.ensembles.drawing import Drawer, DrawParams, check_stop
from chorus.errors import InvalidRequest


class ConsistencySelectParams(DrawParams):
    accuracy: list[float] | None = Field(default=None, description="one per member in [0, 1]: breaks ties")


def choose(stats: list[tuple[str, float, str]], accuracy: dict[str, float]) -> tuple[str, str]:
    """(member, why) from each member's (label, agreement, majority answer), in member order: the highest
    agreement among members that gave an answer, then the higher prior accuracy, then the earlier member."""
    answered = [s for s in stats if s[2]] or stats
    top = max(a for _, a, _ in answered)
    tied = [s for s in answered if abs(s[1] - top) < 1e-12]
    if len(tied) == 1:
        return tied[0][0], f"{tied[0][0]} agrees most with itself ({top:.2f} of its samples)"
    best = max(accuracy.get(label, 0.0) for label, _, _ in tied)
    first = next(label for label, _, _ in tied if accuracy.get(label, 0.0) == best)
    how = f"the higher prior accuracy ({best:g})" if accuracy else "member order"
    return first, f"{len(tied)} members tie at agreement {top:.2f}; {first} by {how}"


class ConsistencySelect(Strategy):
    Params = ConsistencySelectParams
    min_members = 2

    def check(self) -> None:
        check_stop(self.params)
        acc = self.params.accuracy
        if acc is not None and (len(acc) != len(self.members) or any(not 0 <= a <= 1 for a in acc)):
            raise InvalidRequest(f"'accuracy' must be {len(self.members)} numbers in [0, 1] (one per member).",
                                 param="ensemble.accuracy")
        self.accuracy = {m.label: a for m, a in zip(self.members, acc or [])}

    def budget(self) -> Budget:
        return Budget(candidates=self.params.samples * len(self.members))

    async def sample_member(self, d: Drawer, m: Member) -> None:
        """Draw ``m``'s samples in batches until its own stopping rule says its majority is settled."""
        p = self.params
        while True:
            left = p.samples - len(d.samples.get(m.label, []))
            if not await d.draw(m, min(p.batch, left)):
                return
            left = p.samples - len(d.samples[m.label])
            if settled(tally(d.samples[m.label], unfinished=p.unfinished), left, p.stop, p.confidence)[0]:
                return
            if d.call.over_budget(f"{m.label}'s next batch"):
                return

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        kind = answer_kind(call.prompt.question, self.params.answer)
        d = Drawer(call, self.params, kind)
        await gather(*(self.sample_member(d, m) for m in self.members))
        drew = [m for m in self.members if d.samples.get(m.label)]
        if not drew:
            call.survivors([], self.members)  # every member failed: raises with their errors
        p = self.params
        tallies = {m.label: tally(d.samples[m.label], unfinished=p.unfinished) for m in drew}
        stats = [(label, *agreement(d.samples[label], t)) for label, t in tallies.items()]
        label, why = choose(stats, self.accuracy)
        t = tallies[label]
        per: dict[str, Any] = {s[0]: {"agreement": s[1], "answer": s[2], "drawn": tallies[s[0]].drawn,
                                      "histogram": dict(tallies[s[0]].ranked())} for s in stats}
        call.trace.update(d.trace(tally(d.all(), unfinished=p.unfinished), "per member"))
        call.trace.update({"members": per, "winner": {"member": label, "answer": t.winner}, "reason": why})
        for delta in call.reply(ranked_samples(d.samples[label], t)):
            yield delta
