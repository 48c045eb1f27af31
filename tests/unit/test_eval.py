"""`chorus eval` end to end: it starts its own server (fake models), asks GSM8K questions over HTTP, prints a table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from chorus.clients.eval import gold_answer, load_data

CONFIG = """
models:
  - {name: right, engine: fake, fake: {script: "She makes 9 * 2 = 18. The answer is 18.", max_model_len: 4000}}
  - {name: wrong, engine: fake, fake: {script: "The answer is 7.", max_model_len: 4000}}
ensembles:
  - {name: vote, strategy: crowd_vote, metric: word_rouge_l, members: [right, right, wrong]}
"""


def test_gold_answers() -> None:
    assert gold_answer("Janet sells 9 eggs.\n#### 18", "number") == "18"
    assert gold_answer("1,000", "number") == "1000"
    assert gold_answer("B", "choice") == "B"


def test_bad_data_is_reported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"answer": "1"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: need a JSON object with 'question'"):
        load_data(bad, None)


@pytest.mark.parametrize("batch", [False, True], ids=["live", "one-batch"])
def test_eval_compares_models_and_ensembles(tmp_path: Path, batch: bool) -> None:
    data = tmp_path / "three.jsonl"
    janet = {"question": "Janet's ducks lay 16 eggs per day ...?", "answer": "She makes 9 * 2 = $18.\n#### 18"}
    other = {"question": "How many?", "answer": "#### 5"}
    data.write_text("\n".join(json.dumps(x) for x in (janet, other, janet)) + "\n")
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG)
    ens = json.dumps({"strategy": "exchange_of_thought", "members": ["right", "wrong", "right"], "label": "eot",
                      "max_rounds": 2})
    out = subprocess.run(
        [sys.executable, "-m", "chorus", "eval", "--config", str(cfg), "--data", str(data), "--model", "right",
         "--model", "wrong", "--model", "vote", "--ensemble", ens, "--max-tokens", "64", *(["--batch"] * batch)],
        capture_output=True, text=True, timeout=300, check=True,
        env={**os.environ, "CHORUS_BATCH_DIR": str(tmp_path / "batches")}).stdout  # its server's own store
    assert ("one batch" in out) == batch  # the same table either way
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "accuracy" not in line}
    assert rows["right"][:2] == ["0.667 (2/3)", "3/3"] and rows["right"][4] == "1.0" and rows["right"][8] == "right 3"
    assert rows["wrong"][0] == "0.000 (0/3)"
    assert rows["vote"][0] == "0.667 (2/3)" and rows["vote"][4] == "3.0"  # three member calls per question
    assert rows["eot"][0] == "0.667 (2/3)" and rows["eot"][4] == "9.0"  # 18 / 7 / 18 never agree: 3 rounds


MC_CONFIG = """
models:
  - {name: a, engine: fake, fake: {script: "abc abc abc", max_model_len: 4000}}
  - {name: b, engine: fake, fake: {script: "zzz", max_model_len: 4000}}
"""


def test_eval_scores_multiple_choice_data_and_mixes_cached_scores(tmp_path: Path) -> None:
    data = tmp_path / "mc.jsonl"
    rows = [{"id": f"q{i}", "goal": f"goal {i}", "choices": ["abc", "zzz", "cab"], "label": i % 3} for i in range(12)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(MC_CONFIG)
    cache = tmp_path / "cache"
    mix = json.dumps({"label": "avg fit", "members": ["a", "b"], "weights": "fit"})
    cmd = [sys.executable, "-m", "chorus", "eval", "--config", str(cfg), "--data", str(data), "--model", "a",
           "--model", "b", "--mix", mix, "--mix", json.dumps({"label": "conf", "members": ["a", "b"],
                                                             "pool": "confident"}),
           "--mix", json.dumps({"label": "avg", "members": ["a", "b"]}),
           "--ensemble", json.dumps({"label": "served", "strategy": "logit_average", "members": ["a", "b"],
                                     "combine": "probabilities"}), "--cache", str(cache)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    table = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
             for line in first.stdout.splitlines() if line.startswith("| ") and "acc [" not in line}
    assert set(table) == {"a", "b", "served", "avg fit", "conf", "avg"} and table["a"][0] == "12"
    agree = next(line for line in first.stdout.splitlines() if line.startswith("- served (served) vs avg (from"))
    assert float(agree.split("probability ")[1].split()[0]) < 1e-6  # the server's average = the cached scores'
    assert table["served"][2] == table["avg"][2]
    assert table["served"][4] != "-" and table["served"][5] == "2.0"  # vs its best member; two member calls
    assert "weights fitted on the other half" in first.stdout
    assert len((next(cache.iterdir()) / "a.jsonl").read_text().splitlines()) == 12
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    assert "a: 12 items, 12 cached" in again.stderr
    assert again.stdout == first.stdout  # the table again, from the cache alone


def test_addition_problems_are_seeded_and_graded_by_exact_match(tmp_path: Path) -> None:
    from chorus.clients.eval_addition import is_right, problems

    assert problems([2, 3], 4, seed=1) == problems([2, 3], 4, seed=1) != problems([2, 3], 4, seed=2)
    assert all(10 <= a < 100 and 10 <= b < 100 for d, a, b in problems([2], 20, 0) if d == 2)
    assert is_right(" 68\n", 23, 45) and not is_right(" 6 8", 23, 45) and not is_right(" none", 1, 2)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(MC_CONFIG)
    ens = json.dumps({"label": "avg", "strategy": "logit_average", "members": ["a", "b"]})
    spec = json.dumps({"label": "spec", "strategy": "logit_average", "members": ["a", "b"], "mode": "speculative",
                       "versus": "avg"})
    out = subprocess.run([sys.executable, "-m", "chorus", "eval", "addition", "--config", str(cfg), "--n", "3",
                          "--model", "a", "--model", "b", "--ensemble", ens, "--ensemble", spec],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "digit acc" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["a", "b", "avg", "spec"]
    assert "0.0 [0.0, 56.1]" in rows[0] and ("vs a" in rows[2] or "vs b" in rows[2])
    assert "+0.0 [+0.0, +0.0] vs avg (+0/-0), p 1.000" in rows[3]  # speculative answers as full averaging does
