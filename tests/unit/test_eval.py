"""`chorus eval` end to end: it starts its own server (fake models), asks GSM8K questions over HTTP, prints a table."""

from __future__ import annotations

import json
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


def test_eval_compares_models_and_ensembles(tmp_path: Path) -> None:
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
         "--model", "wrong", "--model", "vote", "--ensemble", ens, "--max-tokens", "64"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.splitlines() if line.startswith("| ") and "accuracy" not in line}
    assert rows["right"][:2] == ["0.667 (2/3)", "3/3"] and rows["right"][4] == "1.0" and rows["right"][8] == "right 3"
    assert rows["wrong"][0] == "0.000 (0/3)"
    assert rows["vote"][0] == "0.667 (2/3)" and rows["vote"][4] == "3.0"  # three member calls per question
    assert rows["eot"][0] == "0.667 (2/3)" and rows["eot"][4] == "9.0"  # 18 / 7 / 18 never agree: 3 rounds
