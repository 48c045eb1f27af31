"""``chorus eval tasks`` writes lm-eval task YAMLs for local data directories."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from chorus.clients.lm_eval_tasks import TASKS


def test_writes_one_yaml_per_task(tmp_path: Path) -> None:
    data = tmp_path / "data"
    for file, _, _ in TASKS.values():
        (data / file).parent.mkdir(parents=True, exist_ok=True)
        (data / file).write_text(json.dumps({"goal": "g", "choices": ["a", "b"], "label": 0}) + "\n")
    out = tmp_path / "tasks"
    res = subprocess.run([sys.executable, "-m", "chorus", "eval", "tasks", "--data-dir", str(data), "--out", str(out)],
                         capture_output=True, text=True, check=True)
    assert "lm_eval --model local-completions" in res.stderr
    piqa = yaml.safe_load((out / "piqa_local.yaml").read_text())
    assert piqa["dataset_kwargs"]["data_files"]["validation"] == str((data / "piqa/validation.jsonl").resolve())
    assert piqa["doc_to_text"] == "Question: {{goal}}\nAnswer:" and piqa["validation_split"] == "validation"
    assert piqa["output_type"] == "multiple_choice" and piqa["doc_to_choice"] == "{{choices}}"
    assert yaml.safe_load((out / "arc_easy_local.yaml").read_text())["test_split"] == "test"


def test_a_missing_data_file_is_named(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "chorus", "eval", "tasks", "--data-dir", str(tmp_path), "--out",
                          str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode != 0 and "piqa/validation.jsonl" in res.stderr
