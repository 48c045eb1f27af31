"""Answer types for Exchange-of-Thought: the ``auto`` rules on a labelled table and on real data, extraction per
type, text agreement (normalised text, MiniLM embeddings), and EoT over fake members for each type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from chorus.engines.fake.engine import FakeEngine
from chorus.ensembles.answers.extract import extract_answer, normalise_text
from chorus.ensembles.answers.kinds import AnswerCanon, clean_reply, detect_kind
from tests.helpers import require, serve_fakes

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"

# question -> the answer type a person would compare (the table the rules are documented against)
LABELLED = [
    ("What is 17 * 3?", "number"), ("Compute 120 / 8.", "number"), ("What is 15 plus 27?", "number"),
    ("How many legs does a spider have?", "number"), ("How much is a dozen?", "number"),
    ("A shirt costs $20 and is 25% off. What is the price now?", "number"),
    ("Tom has 3 apples and buys 5 more. How many apples does he have?", "number"),
    ("If a train travels 60 miles in 2 hours, how fast does it go?", "number"),
    ("Sara is 4 years older than Ben, who is 9. How old is Sara?", "number"),
    ("Convert 3 kilometres to metres: what is the result?", "number"),
    ("Is Paris the capital of France?", "yes_no"), ("Does water boil at 100 degrees Celsius at sea level?", "yes_no"),
    ("Can penguins fly?", "yes_no"), ("Was Einstein born in Germany?", "yes_no"),
    ("Are tomatoes fruits?", "yes_no"), ("Did the Romans build the Great Wall of China?", "yes_no"),
    ("Would a pear sink in water?", "yes_no"), ("Should you store bread in a sealed bag to keep it fresh?", "yes_no"),
    ("Has anyone walked on Mars?", "yes_no"), ("Could a llama birth twice during the War in Vietnam?", "yes_no"),
    ("Which is larger (A) the sun (B) the moon?", "choice"),
    ("Question: Which gas do plants absorb?\nA. Oxygen\nB. Carbon dioxide\nC. Helium\nAnswer:", "choice"),
    ("Pick one: (A) red (B) green (C) blue. Which colour is grass?", "choice"),
    ("What is the capital of France?", "text"), ("Who wrote Hamlet?", "text"),
    ("What is the largest planet in the solar system?", "text"), ("Name a river in Egypt.", "text"),
    ("What colour is the sky on a clear day?", "text"), ("Who painted the Mona Lisa?", "text"),
    ("What is the chemical symbol for gold?", "text"), ("Which ocean is the largest?", "text"),
    ("What language is spoken in Brazil?", "text"), ("Is it tea or coffee that has more caffeine per cup?", "text"),
    ("Tell me the name of the first president of the United States.", "text"),
    ("What is the opposite of hot?", "text"), ("In which country is the city of Kyoto?", "text"),
    ("What do bees make?", "text"), ("What is the currency of Japan?", "text"),
]


@pytest.mark.parametrize(("question", "kind"), LABELLED)
def test_auto_on_the_labelled_table(question: str, kind: str) -> None:
    assert detect_kind(question)[0] == kind


def test_auto_on_real_question_sets() -> None:
    """GSM8K's word problems read as numbers; ARC-Easy rendered with lettered options reads as choice."""
    require((DATA / "gsm8k" / "test.jsonl").exists(), f"needs the evaluation data at {DATA}")
    gsm = [json.loads(line)["question"] for line in (DATA / "gsm8k" / "test.jsonl").open()]
    share = sum(detect_kind(q)[0] == "number" for q in gsm) / len(gsm)
    assert len(gsm) > 1000 and share >= 0.99, share
    arc = [json.loads(line) for line in (DATA / "arc-easy" / "test.jsonl").open()][:500]
    rendered = ["Question: " + r["question"] + "\n" + "\n".join(
        f"{lb}. {c}" for lb, c in zip(r["choice_labels"], r["choices"])) + "\nAnswer:" for r in arc]
    lettered = [q for q, r in zip(rendered, arc) if all(lb in "ABCDE" for lb in r["choice_labels"])]
    assert len(lettered) > 450 and all(detect_kind(q)[0] == "choice" for q in lettered)


@pytest.mark.parametrize(("text", "kind", "want"), [
    ("Yes, Paris is the capital.", "yes_no", "yes"),
    ("Penguins cannot fly. The answer is no.", "yes_no", "no"),
    ("No. Well... the answer is Yes", "yes_no", "yes"),
    ("I am not sure.", "yes_no", ""),
    ("Hamlet was written by him. The answer is: **William Shakespeare**.\nMore text", "text", "William Shakespeare"),
    ('The answer is "Paris".', "text", "Paris"),
    ("The capital of France is Paris. It is also the largest city.", "text", "The capital of France is Paris"),
    (" What is the capital of France?\n\nAnswer: The capital of France is Paris.\n", "text",
     "The capital of France is Paris"),  # the question echoed, then a label
    ("Paris is the capital.\n\nThe answer is: X\n\nThe answer is: X", "text", "Paris is the capital"),  # placeholder
    ('X" where X is your short answer (a few words)', "text", ""),
    ("The answer is: Pyongyang\n\nIt is not correct. The answer is not the correct answer. The answer is: X", "text",
     "Pyongyang"),  # a negation and a placeholder after the answer
    ("", "text", ""),
])
def test_extraction_per_type(text: str, kind: str, want: str) -> None:
    assert extract_answer(text, kind) == want


def test_clean_reply_drops_what_the_model_copied_from_its_prompt() -> None:
    reply = ("\nThe capital of France is Paris.\n\nAgent quick:\nThe capital of France is Paris.\n\n"
             "Use the other solutions as extra information")
    assert clean_reply(reply, ["What is the capital of France?"]) == "The capital of France is Paris."
    echoed = " What color is the sky?\n\nAnswer in a few words.\nThe sky is blue.\nUser: and at night?"
    assert clean_reply(echoed, ["What color is the sky?", "Answer in a few words."]) == "The sky is blue."
    assert clean_reply("Agent a: Paris", []) == "Agent a: Paris"  # nothing before the scaffold: kept
    looped = "The answer is yes.\n\nIt is.\n\nThe answer is yes.\n\nThe answer is: X\n\nThe answer is yes."
    assert clean_reply(looped, []) == "The answer is yes.\n\nIt is."
    assert clean_reply("Paris.\nAssistant quick:\nParis.", []) == "Paris."


def test_normalised_text_is_squads() -> None:
    assert normalise_text("The  Eiffel-Tower!") == "eiffel tower" == normalise_text("eiffel tower")
    assert normalise_text("A blue whale.") == "blue whale"


async def test_text_answers_agree_by_normalised_text_and_by_embedding() -> None:
    canon = AnswerCanon("text", threshold=0.85)
    got = await canon.canon(["Paris", "paris.", "Paris, France", "Berlin", "", "The Berlin"])
    assert got == ["Paris", "Paris", "Paris", "Berlin", "", "Berlin"]
    assert canon.how["paris."].startswith("normalised") and canon.how["Paris, France"].startswith("embedding")
    assert (await canon.canon(["Shakespeare", "William Shakespeare"])) == ["Shakespeare", "Shakespeare"]
    strict = AnswerCanon("text", threshold=None)  # normalised text only
    assert await strict.canon(["Paris", "Paris, France", "the paris"]) == ["Paris", "Paris, France", "Paris"]
    assert await AnswerCanon("number").canon(["42", "42.0"]) == ["42", "42.0"]  # other kinds: already canonical


def eot(members: dict[str, str], question: str, **params: Any) -> tuple[str, dict[str, Any]]:
    engines = {n: FakeEngine(n, max_model_len=8192, script=s) for n, s in members.items()}
    ens = [{"name": "eot", "strategy": "exchange_of_thought", "members": list(members), "max_rounds": 2, **params}]
    with serve_fakes(engines, ens) as srv:
        r = OpenAI(base_url=srv.url + "/v1", api_key="x").chat.completions.create(
            model="eot", messages=[{"role": "user", "content": question}], max_tokens=80, temperature=0,
            extra_body={"ensemble": {"trace": True}})
    return r.choices[0].message.content or "", r.model_extra["ensemble"]


def test_eot_text_answers_in_the_members_own_words() -> None:
    """auto reads a general question as text; paraphrased answers agree; the content is the winner's own text."""
    content, trace = eot({"a": "It is Paris, of course. The answer is: Paris.",
                          "b": "The answer is: paris, France", "c": "The answer is: Lyon"},
                         "What is the capital of France?", answer="auto")
    assert trace["answer_type"] == "text" and "none of the" in trace["answer_rule"]
    assert trace["answer"] == "Paris" and content == "It is Paris, of course. The answer is: Paris."
    first = trace["rounds"][0]["agents"]
    assert [a["extracted"] for a in first] == ["Paris", "paris, France", "Lyon"]
    assert [a["answer"] for a in first] == ["Paris", "Paris", "Lyon"]
    assert trace["text_matches"]["paris, France"].startswith("embedding")
    assert len(trace["rounds"]) == 3  # Lyon never agrees: max_rounds


def test_eot_unanimous_text_stops_at_round_zero() -> None:
    _, trace = eot({"a": "The answer is: William Shakespeare", "b": "The answer is: Shakespeare."},
                   "Who wrote Hamlet?", answer="text")
    assert trace["reason"].startswith("unanimous at round 0") and len(trace["rounds"]) == 1


def test_eot_yes_no() -> None:
    content, trace = eot({"a": "Yes. Paris is in France.", "b": "The answer is yes", "c": "No, it is not."},
                         "Is Paris in France?", answer="auto")
    assert trace["answer_type"] == "yes_no" and trace["answer"] == "yes" and content == "Yes. Paris is in France."
    assert [a["answer"] for a in trace["rounds"][-1]["agents"]] == ["yes", "yes", "no"]


def test_eot_auto_keeps_numbers_numeric() -> None:
    _, trace = eot({"a": "6*7 = 42. The answer is 42.", "b": "The answer is 42.0"}, "What is 6*7?", answer="auto")
    assert trace["answer_type"] == "number" and trace["answer"] == "42"
    assert trace["reason"].startswith("unanimous")
