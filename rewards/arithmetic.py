"""Rewards for integer arithmetic answers.

The answer is asked for inside `<answer></answer>`. `correct` reads the tagged
number when there is one and otherwise the last integer in the text, so that a
model which has not learned the format yet still gets credit for the right number
(the format is rewarded by its own component).
"""

from __future__ import annotations

import re

_TAGGED = re.compile(r"<answer>\s*(-?\d[\d,]*)\s*</answer>", re.IGNORECASE)
_STRICT = re.compile(r"^\s*<answer>-?\d+</answer>\s*$")
_INT = re.compile(r"(?<![\d.])-?\d[\d,]*(?![\d.]*\d)")


def extract_answer(text: str) -> int | None:
    """The tagged integer if any, else the last integer in the text.

    >>> extract_answer("so 3 + 4 = <answer>7</answer>")
    7
    >>> extract_answer("The answer is 1,204.")
    1204
    >>> extract_answer("no number") is None
    True
    """
    found = _TAGGED.findall(text) or _INT.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None


def correct(text: str, answer: int) -> float:
    """1.0 when the extracted answer equals `answer`.

    >>> correct("<answer>12</answer>", 12), correct("It is 13", 12)
    (1.0, 0.0)
    """
    return float(extract_answer(text) == answer)


def answer_format(text: str) -> float:
    """1.0 for exactly `<answer>N</answer>` and nothing else, 0.5 when one tagged
    integer appears inside other text, 0.25 for a malformed attempt at the tag, else 0.

    >>> [answer_format(t) for t in ("<answer>42</answer>", "So <answer>42</answer>.", "<answer 42>", "42")]
    [1.0, 0.5, 0.25, 0.0]
    """
    if _STRICT.match(text):
        return 1.0
    if len(_TAGGED.findall(text)) == 1:
        return 0.5
    return 0.25 if "<answer" in text.lower() else 0.0


def reward(task, completion: str) -> dict[str, float]:
    """Components for one completion of an arithmetic task (payload['answer'])."""
    answer = int(task.payload["answer"])
    return {"correct": correct(completion, answer), "format": answer_format(completion)}
