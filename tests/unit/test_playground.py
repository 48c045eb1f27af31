"""The playground page in a real browser: Debian's chromium driven by playwright (``executable_path``; no browser
download), against a live gateway over fake engines whose ensembles produce real traces. Every number the page
draws is checked against the trace the openai SDK gets for the same request.

``CHORUS_SCREENSHOTS=docs/img`` writes the screenshots the docs show (``make screenshots``)."""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from chorus.config import ChorusConfig
from chorus.engines.fake.engine import FakeEngine
from tests.helpers import LiveServer, gateway, require

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INSTALL = "apt-get install chromium; pip install playwright (never `playwright install`)"
KEY = "sk-playground"
QUESTION = "What is 6*7?"


def engines() -> dict[str, FakeEngine]:
    return {"a": FakeEngine("a", max_model_len=4096, script="The answer is 42."),
            "b": FakeEngine("b", max_model_len=4096, script="The answer is 42!"),
            "c": FakeEngine("c", max_model_len=4096, script="It is 41."),
            "slow": FakeEngine("slow", max_model_len=4096, delay=0.03, script="Slowly, one token after another.")}


ENSEMBLES: list[dict[str, Any]] = [
    {"name": "avg", "strategy": "logit_average", "members": ["a", "b"]},
    {"name": "vote", "strategy": "crowd_vote", "members": ["a", "b", "c"], "metric": "word_rouge_l"},
    {"name": "eot", "strategy": "exchange_of_thought", "members": ["a", "b", "c"], "max_rounds": 2,
     "instruction": "Answer."},
    {"name": "moa", "strategy": "mixture_of_agents", "members": ["a", "b", "slow"], "quorum": 2, "rationale": True},
    {"name": "route", "strategy": "route", "router": "random", "members": ["a", "b"], "weights": [0.0, 1.0]},
    {"name": "cascade", "strategy": "cascade", "members": ["c", "a"], "threshold": -0.01},
]
NAMES = {e["name"] for e in ENSEMBLES}


def config(keys: bool = False) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "models": [{"name": n, "engine": "fake"} for n in engines()], "ensembles": ENSEMBLES,
        "prices": {"a": {"prompt": 1.0, "completion": 2.0}, "b": {"prompt": 1.0, "completion": 2.0},
                   "c": {"prompt": 0.5, "completion": 1.0}, "slow": {"prompt": 0.0, "completion": 0.0}}}
    if keys:
        cfg["auth"] = {"keys": [{"name": "user", "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]}
    return cfg


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with gateway(config(), engines()) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require(CHROMIUM is not None, f"needs chromium ({INSTALL})")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require(False, f"needs playwright ({INSTALL})")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        yield b
        b.close()


class Page:
    """One browser page on the playground, recording console errors and failed requests."""

    def __init__(self, browser: Any, url: str, width: int = 1280, height: int = 800) -> None:
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("console", lambda m: self.problems.append(f"console {m.type}: {m.text}")
                     if m.type in ("error", "warning") else None)
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.goto(url + "/playground")

    def run(self, models: list[str], prompt: str = QUESTION, max_tokens: int = 30) -> None:
        from playwright.sync_api import expect

        for m in models:
            self.page.check(f"#model-list input[value='{m}']")
        self.page.fill("#prompt", prompt)
        self.page.fill("#max-tokens", str(max_tokens))
        self.page.click("#run-chat")
        expect(self.page.locator(".column[data-done]")).to_have_count(len(models), timeout=60_000)

    def column(self, model: str) -> Any:
        return self.page.locator(f".column[data-model='{model}']")

    def values(self, selector: str) -> list[float]:
        return [float(v) for v in self.page.locator(selector).evaluate_all(
            "els => els.map(e => e.getAttribute('data-value'))")]

    def shot(self, name: str) -> None:
        where = os.environ.get("CHORUS_SCREENSHOTS")
        if where:
            Path(where).mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(Path(where) / f"playground-{name}.png"), full_page=True)

    def close(self) -> None:
        self.context.close()


def traced(srv: LiveServer, model: str, max_tokens: int = 30) -> tuple[str, dict[str, Any]]:
    """What the SDK gets for the page's request: the answer and the ensemble's trace."""
    client = OpenAI(base_url=srv.url + "/v1", api_key="x")
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                       max_tokens=max_tokens, temperature=0,
                                       extra_body={"ensemble": {"trace": True}} if model in NAMES else None)
    return r.choices[0].message.content or "", (r.model_extra or {}).get("ensemble", {})


def test_the_page_lists_the_models_and_streams_each_column(server: LiveServer, browser: Any) -> None:
    from playwright.sync_api import expect

    page = Page(browser, server.url)
    listed = page.page.locator("#model-list input").evaluate_all("els => els.map(e => e.value)")
    assert listed == [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]]
    # four columns at most: a fifth box is disabled once four are ticked
    for m in ("a", "avg", "vote", "slow"):
        page.page.check(f"#model-list input[value='{m}']")
    assert page.page.locator("#model-list input[value='eot']").is_disabled()
    page.page.fill("#prompt", QUESTION)
    page.page.fill("#max-tokens", "40")
    page.page.click("#run-chat")
    # streamed: the slow model's column shows part of its answer before it is done
    slow = page.column("slow")
    expect(slow.locator(".output")).not_to_have_text("", timeout=20_000)
    partial = slow.locator(".output").inner_text()
    assert slow.get_attribute("data-done") is None and 0 < len(partial) < len("Slowly, one token after another.")
    expect(page.page.locator(".column[data-done]")).to_have_count(4, timeout=60_000)
    for m in ("a", "avg", "vote", "slow"):
        answer, _ = traced(server, m, 40)
        assert page.column(m).locator(".output").inner_text() == answer
    # latency, tokens and cost: a's usage priced at 1 / 2 per million tokens
    stats = page.column("a").locator(".stats").inner_text()
    client = OpenAI(base_url=server.url + "/v1", api_key="x")
    u = client.chat.completions.create(model="a", messages=[{"role": "user", "content": QUESTION}], max_tokens=40).usage
    assert f"{u.prompt_tokens} + {u.completion_tokens} tokens" in stats and "first token" in stats
    assert f"cost {(u.prompt_tokens * 1 + u.completion_tokens * 2) / 1e6:.6f}" in stats
    page.shot("columns")
    assert page.problems == []
    page.close()


def test_each_trace_view_draws_the_traces_numbers(server: LiveServer, browser: Any) -> None:
    page = Page(browser, server.url)
    page.run(["avg", "vote", "eot", "cascade"])
    # crowd voting: heatmap cells are the similarity matrix, the winner's row marked
    _, vote = traced(server, "vote")
    cells = page.values(".column[data-model='vote'] td.cell")
    assert cells == pytest.approx([v for row in vote["similarity"] for v in row])
    rows = page.column("vote").locator("tr.winner")
    assert rows.count() == 1 and rows.get_attribute("data-index") == str(vote["winner"]["index"])
    assert page.values(".column[data-model='vote'] td.score") == pytest.approx(vote["scores"])
    # logit averaging: one span per token, coloured as its agreement says, members' top tokens on hover
    _, avg = traced(server, "avg")
    tokens = avg["token_ensemble"]["tokens"]
    spans = page.column("avg").locator(".tok")
    assert spans.count() == len(tokens)
    assert spans.evaluate_all("els => els.map(e => e.textContent)") == [t["text"] for t in tokens]
    agreements = spans.evaluate_all("els => els.map(e => Number(e.dataset.agreement))")
    assert agreements == [t["agreement"] for t in tokens] and min(agreements) == 0.5
    colours = spans.evaluate_all("els => els.map(e => getComputedStyle(e).backgroundColor)")
    assert len(set(colours)) == 2 and colours[0] != colours[-1]  # all-agree tokens one colour, the split one another
    last = spans.nth(len(tokens) - 1)
    last.hover()
    detail = page.column("avg").locator(".tok-detail").inner_text()
    assert '"!"' in detail and '"."' in detail and "b: p=" in detail
    # Exchange-of-Thought: a timeline of rounds with each member's answer
    _, eot = traced(server, "eot")
    rounds = page.column("eot").locator(".timeline > li")
    assert rounds.count() == len(eot["rounds"])
    shown = page.column("eot").locator(".agent .answer").evaluate_all("els => els.map(e => e.dataset.answer)")
    assert shown == [a["answer"] for r in eot["rounds"] for a in r["agents"]]
    assert page.column("eot").locator(".final-answer").inner_text() == eot["answer"]
    assert page.column("eot").locator(".answer-type").get_attribute("data-type") == eot["answer_type"] == "number"
    # cascade: the escalation path with each step's confidence
    _, cas = traced(server, "cascade")
    steps = page.column("cascade").locator(".path .step")
    assert steps.evaluate_all("els => els.map(e => e.dataset.member)") == [s["member"] for s in cas["steps"]]
    assert page.values(".column[data-model='cascade'] .step [data-value]") == pytest.approx(
        [s["confidence"] for s in cas["steps"]])
    assert page.column("cascade").locator(".step.accepted").get_attribute("data-member") == cas["winner"]["member"]
    page.shot("traces")
    assert page.problems == []
    page.close()


def test_router_and_mixture_of_agents_views(server: LiveServer, browser: Any) -> None:
    page = Page(browser, server.url)
    page.run(["moa", "route"])
    answer, moa = traced(server, "moa")
    proposals = page.column("moa").locator(".proposal:not(.late)")
    assert proposals.evaluate_all("els => els.map(e => e.dataset.member)") == [p["member"] for p in moa["layers"][0]]
    late = page.column("moa").locator(".proposal.late")
    assert late.evaluate_all("els => els.map(e => e.dataset.member)") == moa["quorum"]["layers"][0]["late"] == ["slow"]
    assert page.column("moa").locator(".rationale .text").inner_text() == moa["judge"]["rationale"]
    assert page.column("moa").locator(".aggregate .text").inner_text() == answer
    _, route = traced(server, "route")
    won = page.column("route").locator("tr.winner")
    assert won.get_attribute("data-member") == route["winner"]["member"] == "b"  # weight 0 for a
    assert page.values(".column[data-model='route'] td.score") == route["weights"]
    assert page.problems == []
    page.close()


def test_multiple_choice_shows_each_members_and_the_ensembles_probabilities(server: LiveServer, browser: Any) -> None:
    from playwright.sync_api import expect

    page = Page(browser, server.url)
    page.page.click("#tab-choices")
    for m in ("a", "avg"):
        page.page.check(f"#model-list input[value='{m}']")
    choices = ["The answer is 42.", "It is 41."]
    page.page.fill("#question", "Q: 6*7?\nA: ")
    page.page.fill("#choice-lines", "\n".join(choices))
    page.page.click("#run-choices")
    expect(page.page.locator(".column[data-done]")).to_have_count(2, timeout=30_000)
    for m in ("a", "avg"):
        want = httpx.post(server.url + "/v1/choices", json={"model": m, "prompt": "Q: 6*7?\nA: ", "choices": choices})
        sums = [c["probabilities"]["sum"] for c in want.json()["choices"]]
        assert page.values(f".column[data-model='{m}'] td.prob") == pytest.approx(sums, abs=1e-6)
    alone = httpx.post(server.url + "/v1/choices", json={"model": "b", "prompt": "Q: 6*7?\nA: ", "choices": choices})
    assert page.values(".column[data-model='avg'] td.member-prob[data-member='b']") == pytest.approx(
        [c["probabilities"]["sum"] for c in alone.json()["choices"]], abs=1e-3)
    page.page.select_option("#normalisation", "char")  # redrawn under another normalisation
    want = httpx.post(server.url + "/v1/choices", json={"model": "a", "prompt": "Q: 6*7?\nA: ", "choices": choices})
    assert page.values(".column[data-model='a'] td.prob") == pytest.approx(
        [c["probabilities"]["char"] for c in want.json()["choices"]], abs=1e-6)
    page.shot("choices")
    assert page.problems == []
    page.close()


def test_an_api_error_is_shown_as_the_api_says_it(server: LiveServer, browser: Any) -> None:
    page = Page(browser, server.url)
    page.page.fill("#temperature", "5")
    page.run(["a"])
    client = OpenAI(base_url=server.url + "/v1", api_key="x")
    with pytest.raises(Exception) as info:
        client.chat.completions.create(model="a", messages=[{"role": "user", "content": QUESTION}], temperature=5)
    message = info.value.body["message"]  # type: ignore[attr-defined]
    shown = page.column("a").locator(".error-box").inner_text()
    assert shown.startswith("400: ") and message in shown and "temperature" in shown
    # the page's own network log has the 400 as a console error from the browser; nothing else went wrong
    assert all("400" in p for p in page.problems)
    page.close()


def test_the_api_key_is_asked_for_and_kept_for_the_session_only(browser: Any) -> None:
    with gateway(config(keys=True), engines()) as srv:
        page = Page(browser, srv.url)
        status = page.page.locator("#status")
        from playwright.sync_api import expect

        expect(status).to_contain_text("401")
        expect(status).to_contain_text("enter the API key")
        page.page.fill("#api-key", KEY)
        page.page.press("#api-key", "Enter")
        expect(page.page.locator("#model-list input")).to_have_count(len(engines()) + len(ENSEMBLES))
        page.run(["a"])
        assert page.column("a").locator(".output").inner_text() == "The answer is 42."
        stored = page.page.evaluate("() => [sessionStorage.getItem('chorus-api-key'), localStorage.length]")
        assert stored == [KEY, 0]
        page.close()


def test_phone_width_and_the_keyboard(server: LiveServer, browser: Any) -> None:
    page = Page(browser, server.url, width=390, height=844)
    kb = page.page.keyboard
    page.page.focus("#model-list input[value='avg']")
    kb.press("Space")
    page.page.focus("#model-list input[value='vote']")
    kb.press("Space")
    page.page.focus("#prompt")
    kb.type(QUESTION)
    kb.press("Control+Enter")
    from playwright.sync_api import expect

    expect(page.page.locator(".column[data-done]")).to_have_count(2, timeout=30_000)
    # one column under the other, nothing wider than the screen
    boxes = [page.column(m).bounding_box() for m in ("avg", "vote")]
    assert boxes[0] and boxes[1] and boxes[1]["y"] > boxes[0]["y"] + boxes[0]["height"] - 1
    assert page.page.evaluate("() => document.documentElement.scrollWidth") <= 390
    # the token view by keyboard: focusing a token shows its members' top tokens
    page.column("avg").locator(".tok").first.focus()
    assert "agreement" in page.column("avg").locator(".tok-detail").inner_text()
    # tabs by arrow keys
    page.page.focus("#tab-chat")
    kb.press("ArrowRight")
    assert page.page.locator("#choices-form").is_visible() and not page.page.locator("#chat-form").is_visible()
    page.shot("phone")
    assert page.problems == []
    page.close()


def test_the_page_is_static_files_with_a_strict_policy(server: LiveServer) -> None:
    r = httpx.get(server.url + "/playground", follow_redirects=True)
    assert r.status_code == 200 and "<title>chorus playground</title>" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for name in ("playground.js", "traces.js", "playground.css"):
        body = httpx.get(f"{server.url}/playground/{name}").text
        assert "http://" not in body and "https://" not in body  # nothing from another origin
    assert httpx.get(server.url + "/playground/../config.yaml").status_code == 404
    assert httpx.get(server.url + "/playground/secret.txt").status_code == 404
    cfg = config()
    cfg["server"] = {"playground": False}
    with gateway(cfg, engines()) as off:
        assert httpx.get(off.url + "/playground/").status_code == 404


def test_the_first_view_opens_on_the_ids_that_answer_well(browser: Any) -> None:
    """On a server with the default line-up's names, the first load checks Qwen2.5-Coder-0.5B, sc-default and the
    semantic router (the newcomer set's best ids) and offers a question, so one click runs it; descriptions are
    tooltips."""
    from playwright.sync_api import expect

    q, smol = "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct"
    cfg = {"models": [{"name": n, "engine": "fake", "description": f"{n} model"} for n in (q, smol, "gemma-3-270m")],
           "ensembles": [{"name": "sc-default", "strategy": "answer_vote", "members": [q],
                          "description": "self-consistency"},
                         {"name": "route-default", "strategy": "cascade", "members": [smol, q],  # (the name counts)
                          "threshold": -0.6},
                         {"name": "vote-default", "strategy": "crowd_vote", "members": [q, smol]}]}
    with gateway(ChorusConfig.model_validate(cfg), {n: FakeEngine(n) for n in (q, smol, "gemma-3-270m")}) as srv:
        page = Page(browser, srv.url)
        try:
            boxes = page.page.locator("#model-list input")
            expect(boxes).to_have_count(6)
            checked = sorted(boxes.evaluate_all("els => els.filter(e => e.checked).map(e => e.value)"))
            assert checked == [q, "route-default", "sc-default"]
            assert page.page.input_value("#prompt").startswith("What is the capital of France?")
            label = page.page.locator("#model-list label", has_text="gemma-3-270m")
            assert label.get_attribute("title") == "gemma-3-270m model"
            assert not page.problems
        finally:
            page.close()
