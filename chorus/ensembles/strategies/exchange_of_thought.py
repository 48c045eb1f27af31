"""``exchange_of_thought``: members solve, see each other's solutions, and solve again (docs/methods.md §2).

Round 0: every agent answers. If all answers agree, stop before any exchange. Each later round, agent
i sees its own latest solution and those of the peers its row of the visibility matrix names (from
round 2 on with each peer's confidence), and writes a fresh solution. Stop when all latest answers
agree, or after ``max_rounds``, or once the request's bounds are spent (``deadline_s``, ``max_total_tokens``:
no new round starts). Each agent's answer is its latest extractable one (a small model that loses its answer in
a later round, e.g. by copying the instruction's placeholder, keeps the one it gave before; agents that never gave
one are ignored); the final answer is their majority (ties to the earliest agent), and the content is the first
agent with that answer's solution from the round it gave it, in its own words. Members of a round run
concurrently; each call's length is the request's ``max_tokens`` (else ``call_max_tokens``).

``answer`` says what kind of answer is compared: ``number``, ``choice`` (a letter), ``yes_no``, ``text``
(a short free-text answer: two agree when their normalised texts are equal or their embeddings' cosine is
at least ``text_threshold``; answers/kinds.py), or ``auto``, which picks one of those from the question with
the rules of `kinds.detect_kind` (named in the trace).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chorus.engines.core.base import Delta
from chorus.ensembles import spans
from chorus.ensembles.answers.extract import compile_pattern, extract_answer
from chorus.ensembles.answers.kinds import AnswerCanon, answer_kind, clean_reply
from chorus.ensembles.base import Budget, Strategy
from chorus.ensembles.call import Call, Member, gather, replace_question
from chorus.errors import InvalidRequest

TOPOLOGIES = ("memory", "report", "relay", "debate")
INSTRUCTION = {"number": 'Solve it step by step, and end with "The answer is X" where X is a number.',
               "choice": 'Solve it step by step, and end with "The answer is (X)" where X is the option letter.',
               "yes_no": 'Think it through briefly, and end with "The answer is yes" or "The answer is no".',
               "text": 'Answer briefly, and end with "The answer is: X" where X is your short answer (a few '
                       'words).'}


def visibility(topology: str, n: int) -> list[list[bool]]:
    """``sees[i][j]``: agent i sees agent j's solution. The paper's table, generalised to n agents:
    memory = everyone; report = the centre (0) sees all, the others see the centre; relay = a ring
    (i sees i+1); debate = the root (0) sees all, the others see each other but not the root."""
    rule = {
        "memory": lambda i, j: True,
        "report": lambda i, j: i == 0 or j == 0,
        "relay": lambda i, j: j == (i + 1) % n,
        "debate": lambda i, j: i == 0 or j != 0,
    }[topology]
    return [[i != j and rule(i, j) for j in range(n)] for i in range(n)]


def confidence(history: list[str]) -> float | None:
    """Share of the agent's own answers (initial included) that equal its most frequent non-empty one."""
    if len(history) < 2:
        return None
    counts = Counter(a for a in history if a)
    return max(counts.values()) / len(history) if counts else 0.0


def agreed(answers: list[str]) -> bool:
    return bool(answers) and all(answers) and len(set(answers)) == 1


def majority(answers: list[str]) -> str:
    counts = Counter(a for a in answers if a)  # insertion order breaks ties: the earliest agent
    return counts.most_common(1)[0][0] if counts else ""


class EoTParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    topology: Literal["memory", "report", "relay", "debate"] = "memory"
    visibility: list[list[int]] | None = Field(default=None, description="custom n x n 0/1 matrix: row i = whom i sees")
    max_rounds: int = Field(default=5, ge=0, le=10)
    answer: Literal["number", "choice", "yes_no", "text", "auto"] = "number"
    text_threshold: float | None = Field(default=0.85, ge=-1, le=1, description=(
        "text answers: the embedding cosine at or above which two agree (null: normalised text only)"))
    answer_pattern: str | None = Field(default=None, description="regex; its first group is the answer")
    instruction: str | None = Field(
        default=None, description="appended to the question (default: ask for 'The answer is X')"
    )

    @field_validator("answer_pattern")
    @classmethod
    def _pattern(cls, v: str | None) -> str | None:
        compile_pattern(v)
        return v


class ExchangeOfThought(Strategy):
    Params = EoTParams

    def budget(self) -> Budget:
        return Budget(rounds=self.params.max_rounds)

    def check(self) -> None:
        n = len(self.members)
        v = self.params.visibility
        if v is not None and (len(v) != n or any(len(row) != n or any(x not in (0, 1) for x in row) for row in v)):
            raise InvalidRequest(f"'visibility' must be a {n} x {n} matrix of 0 and 1 (one row and column per member).",
                                 param="ensemble.visibility")
        self.sees = ([[bool(x) and i != j for j, x in enumerate(row)] for i, row in enumerate(v)] if v is not None
                     else visibility(self.params.topology, n))
        self.pattern = compile_pattern(self.params.answer_pattern)

    def answer_of(self, text: str, kind: str) -> str:
        return extract_answer(text, kind, self.pattern)

    def reply_text(self, text: str, question: str, kind: str) -> str:
        """A yes/no or text reply without the prompt a small model copied into it (answers.kinds.clean_reply);
        number and choice replies as they are (the reference behaviour)."""
        return clean_reply(text, [question, self.instruction(kind)]) if kind in ("yes_no", "text") else text

    def instruction(self, kind: str) -> str:
        return self.params.instruction if self.params.instruction is not None else INSTRUCTION[kind]

    def exchange_prompt(self, question: str, own: str, peers: list[tuple[str, str, float | None]],
                        kind: str) -> str:
        parts = [question, f"Your previous solution:\n{own}", "Solutions from other agents:"]
        for label, text, conf in peers:
            parts.append(f"Agent {label}" + (f" (confidence {conf:.2f})" if conf is not None else "") + f":\n{text}")
        if not peers:
            parts.pop()
        if any(conf is not None for _, _, conf in peers):
            parts.append("A confidence below 0.5 means that solution is probably wrong, but a high confidence "
                         "can also be wrong.")
        parts.append("Use the other solutions as extra information, think again, and write a fresh solution. "
                     + self.instruction(kind))
        return "\n\n".join(parts)

    async def stream(self, call: Call) -> AsyncGenerator[Delta, None]:
        question = call.prompt.question
        base = call.prompt.as_messages()
        rounds: list[dict[str, Any]] = []
        kind, rule = answer_kind(question, self.params.answer)
        canon = AnswerCanon(kind, self.params.text_threshold)
        call.trace.update({"topology": self.params.topology if self.params.visibility is None else "custom",
                           "visibility": [[int(x) for x in row] for row in self.sees],
                           "answer_type": kind, "answer_rule": rule, "rounds": rounds})
        with spans.step("eot.round", call.scope, chorus__round=0):
            gens = await gather(*(call.generate(m, instruction=self.instruction(kind)) for m in self.members))
        active: list[Member] = []
        text: dict[int, str] = {}
        finish: dict[int, str] = {}
        history: dict[int, list[str]] = {}
        agents: list[dict[str, Any]] = []
        for m, g in call.survivors(gens, self.members):
            active.append(m)
            text[m.index], finish[m.index] = self.reply_text(g.choices[0].text, question, kind), g.choices[0].finish_reason
            agents.append({"member": m.label, "sees": [], "extracted": self.answer_of(text[m.index], kind),
                           "text": text[m.index]})
        said: dict[int, tuple[str, str, str]] = {}  # per agent: its latest extractable answer, with text and finish
        for m, a, c in zip(active, agents, await canon.canon([a["extracted"] for a in agents])):
            history[m.index] = [c]
            a["answer"] = c
            if c:
                said[m.index] = (c, text[m.index], finish[m.index])
        rounds.append({"round": 0, "agents": agents})
        latest = [said.get(m.index, ("",))[0] for m in active]
        if agreed(latest):
            reason = "unanimous at round 0: stopped before any exchange"
        else:
            reason = f"max_rounds ({self.params.max_rounds}) reached: majority of the last round"
            for r in range(1, self.params.max_rounds + 1):
                if call.over_budget(f"round {r}"):
                    reason = f"{call.stopped}: majority of the last round"
                    break
                prompts: list[list[dict[str, Any]]] = []
                agents = []
                for m in active:
                    peers = [p for p in active if self.sees[m.index][p.index]]
                    conf = {p.label: confidence(history[p.index]) if r >= 2 else None for p in peers}
                    prompts.append(replace_question(base, self.exchange_prompt(
                        question, text[m.index], [(p.label, text[p.index], conf[p.label]) for p in peers], kind)))
                    agents.append({"member": m.label, "sees": [p.label for p in peers],
                                   "peer_confidence": {k: v for k, v in conf.items() if v is not None}})
                with spans.step("eot.round", call.scope, chorus__round=r):
                    replies = await gather(*(call.generate(m, msgs) for m, msgs in zip(active, prompts)))
                kept = []
                for m, reply, a in zip(active, replies, agents):
                    if reply is None:
                        a["error"] = True
                        continue
                    kept.append(m)
                    text[m.index] = self.reply_text(reply.choices[0].text, question, kind)
                    finish[m.index] = reply.choices[0].finish_reason
                    a.update(extracted=self.answer_of(text[m.index], kind), text=text[m.index])
                done = [(m, a) for m, a in zip(active, agents) if m in kept]
                for (m, a), c in zip(done, await canon.canon([a["extracted"] for _, a in done])):
                    history[m.index].append(c)
                    a["answer"] = c
                    if c:
                        said[m.index] = (c, text[m.index], finish[m.index])
                active = [m for m, _ in call.survivors([m if m in kept else None for m in active], active)]
                rounds.append({"round": r, "agents": agents})
                latest = [said.get(m.index, ("",))[0] for m in active]
                if agreed(latest):
                    reason = f"all agents agreed after round {r}"
                    break
        final = majority(latest)
        winner = next((m for m in active if latest[active.index(m)] == final), active[0])
        if final:  # the winner's words where it gave that answer (a later round may have lost its answer)
            _, text[winner.index], finish[winner.index] = said[winner.index]
        if not final:
            reason += "; no agent gave an extractable answer"
        if kind == "text":
            call.trace["text_matches"] = canon.how  # how each extracted answer was matched to a canonical one
        call.trace.update({"answer": final, "winner": {"member": winner.label}, "reason": reason,
                           "confidence": {m.label: confidence(history[m.index]) for m in active}})
        yield Delta(0, text[winner.index], finish_reason=finish[winner.index])
