"""``chorus eval tasks``: lm-evaluation-harness task YAMLs for local multiple-choice JSONL files.

The files hold ``choices`` and ``label`` plus the question text (PIQA ``goal``, ARC ``question``,
HellaSwag ``context``). The prompts are lm-eval's built-in ones for these sets ("Question: ...\\nAnswer:"
with " " + choice; HellaSwag's context as given, already joined). The YAMLs name the data files by
absolute path, so they are written for a data directory, not kept with one baked in.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

#: task name -> (file under the data directory, lm-eval split name, doc_to_text)
TASKS: dict[str, tuple[str, str, str]] = {
    "piqa_local": ("piqa/validation.jsonl", "validation", "Question: {{goal}}\nAnswer:"),
    "arc_easy_local": ("arc-easy/test.jsonl", "test", "Question: {{question}}\nAnswer:"),
    "hellaswag_local": ("hellaswag/validation.jsonl", "validation", "{{context}}"),
}
METRICS = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]


def task_yaml(name: str, data_file: Path, split: str, doc_to_text: str) -> str:
    """One task as YAML (JSON is YAML: no YAML library needed to write it)."""
    task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {split: str(data_file)}},
            "output_type": "multiple_choice", f"{split}_split": split, "doc_to_text": doc_to_text,
            "doc_to_target": "label", "doc_to_choice": "{{choices}}", "metric_list": METRICS}
    return json.dumps(task, indent=2) + "\n"


def write_tasks(data_dir: Path, out: Path) -> list[Path]:
    data_dir = data_dir.expanduser().resolve()
    missing = [str(data_dir / f) for f, _, _ in TASKS.values() if not (data_dir / f).is_file()]
    if missing:
        raise SystemExit(f"chorus eval tasks: missing data file(s): {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, (file, split, text) in TASKS.items():
        path = out / f"{name}.yaml"
        path.write_text(task_yaml(name, data_dir / file, split, text))
        written.append(path)
    return written


def main(args: argparse.Namespace) -> int:
    for path in write_tasks(Path(args.data_dir), Path(args.out)):
        print(path)
    print(f"run: lm_eval --model local-completions --include_path {args.out} --tasks "
          f"{','.join(TASKS)} --model_args model=NAME,base_url=http://127.0.0.1:8000/v1/completions,"
          "tokenizer_backend=huggingface,tokenizer=MODEL_DIR", file=sys.stderr)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", required=True, help="directory with piqa/, arc-easy/ and hellaswag/ JSONL files")
    p.add_argument("--out", required=True, help="directory to write the task YAMLs into")
