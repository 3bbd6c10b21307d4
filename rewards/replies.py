"""Rewards for a short reply to a post: six heuristic components, each in [0, 1].

- `relevance`: the post's keywords the reply mentions (a shared 5-letter stem or the
  same word without its ending counts: "plants" for "plant", "move" for "moving"), full
  marks at two; 0 for a reply that mostly repeats the post (half its word trigrams
  are the post's).
- `length`: 1 inside the target band of words, falling linearly outside it.
- `tone`: 1, less 0.5 for a rude or dismissive word, 0.25 for shouting (two or more
  all-caps words), 0.25 for "!!" or "??".
- `no_repetition`: the share of the reply's word trigrams that are distinct.
- `punctuation`: the share of five checks passed: starts with a capital (or a digit or
  quote), ends with . ! ? or a closing quote/bracket after one, no run of three equal
  punctuation marks, no space before , . ! ?, balanced brackets and double quotes.
- `diversity`: 1 - the reply's BLEU against the other replies of its group
  (mlx_grpo/textstats.py), paid to relevant replies in the length band only (else
  junk, unlike anything, would be the most diverse); needs the group, so the recipe
  scores whole groups; a group of one scores 1.

These are heuristics: none checks that the words are English. Fluency needs the judge
(recipe.toml says how to add it).

`success` (logged, and what compare's pass@k counts; give it no weight) marks a good
reply: relevant, in the band, polite, punctuated, with at most one repeated trigram.
"""

from __future__ import annotations

import re

from mlx_grpo.textstats import self_bleu_each

RUDE = {
    "stupid", "idiot", "dumb", "shut", "hate", "loser", "pathetic", "whatever",
    "ridiculous", "lame", "moron", "ugly", "useless", "awful", "boring", "crap",
}  # fmt: skip
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")


def words(text: str) -> list[str]:
    return _WORD.findall(text)


_ENDING = re.compile(r"(?:ing|ed|es|s|e)$")


def _root(w: str) -> str:
    """The word without one common ending ("moving", "move" -> "mov"); words shorter
    than four letters keep theirs, and relevance compares roots of such words only."""
    return _ENDING.sub("", w) if len(w) >= 4 else w


def relevance(text: str, keywords: list[str], full_at: int = 2, post: str = "") -> float:
    """Keywords mentioned (a shared 5-letter stem or root counts), `full_at` for full
    marks; 0 when at least half the reply's word trigrams are the post's own.

    >>> relevance("Kittens love a quiet shelter corner.", ["kitten", "shelter", "tips"])
    1.0
    >>> relevance("Nice!", ["kitten"]), relevance("Good luck with the move!", ["moving"])
    (0.0, 1.0)
    >>> relevance("I do not know.", ["notes"])
    0.0
    >>> relevance("Just adopted a kitten from the shelter!", ["kitten", "shelter"],
    ...           post="Just adopted a kitten from the shelter! Any tips?")
    0.0
    """
    ws = {w.lower() for w in words(text)}
    if post and echo(text, post) >= 0.5:
        return 0.0
    hits = 0
    for k in keywords:
        k = k.lower()
        stem = k[:5]
        if any(
            w == k
            or (len(stem) >= 4 and w.startswith(stem))
            or (min(len(w), len(k)) >= 4 and _root(w) == _root(k))  # ("not" is no "notes")
            for w in ws
        ):
            hits += 1
    return min(1.0, hits / min(full_at, len(keywords))) if keywords else 0.0


def _trigrams(text: str) -> list[tuple[str, ...]]:
    ws = [w.lower() for w in words(text)]
    return [tuple(ws[i : i + 3]) for i in range(len(ws) - 2)]


def echo(text: str, post: str) -> float:
    """The share of the reply's word trigrams that are in the post (0 below three words).

    >>> echo("Moving to a new city is exciting.", "Moving to a new city alone next week.")
    0.6
    """
    grams, seen = _trigrams(text), set(_trigrams(post))
    return sum(g in seen for g in grams) / len(grams) if grams else 0.0


def length_band(text: str, lo: int = 8, hi: int = 50) -> float:
    """1 for lo..hi words, else falling linearly (0 at 0 words and at 2 * hi).

    >>> length_band("one two three four", 8, 50), length_band("w " * 60, 8, 50)
    (0.5, 0.8)
    """
    n = len(words(text))
    if n < lo:
        return n / lo
    if n > hi:
        return max(0.0, 1.0 - (n - hi) / hi)
    return 1.0


def tone(text: str) -> float:
    """Politeness heuristic: rude words, shouting, "!!".

    >>> tone("That sounds lovely, enjoy it."), tone("That is STUPID and USELESS!!")
    (1.0, 0.0)
    """
    if not text.strip():
        return 0.0
    ws = words(text)
    score = 1.0
    if any(w.lower() in RUDE for w in ws):
        score -= 0.5
    if sum(w.isupper() and len(w) >= 3 for w in ws) >= 2:
        score -= 0.25
    if "!!" in text or "??" in text:
        score -= 0.25
    return max(0.0, score)


def no_repetition(text: str) -> float:
    """Distinct word trigrams / trigrams (1 for fewer than three words).

    >>> round(no_repetition("I love it. I love it. I love it."), 2), no_repetition("Have a great trip")
    (0.43, 1.0)
    """
    grams = _trigrams(text)
    return len(set(grams)) / len(grams) if grams else 1.0


def punctuation(text: str) -> float:
    """The share of five punctuation checks passed (see the module docstring).

    >>> punctuation("Great news, congratulations!"), punctuation("great news ,congrats!!!")
    (1.0, 0.4)
    """
    t = text.strip()
    if not t:
        return 0.0
    checks = [
        t[0].isupper() or t[0].isdigit() or t[0] in "\"'(",
        bool(re.search(r"[.!?][\"')\]]*$", t)),
        not re.search(r"([!?.,;:])\1\1", t),
        not re.search(r"\s[,.!?;:]", t),
        t.count("(") == t.count(")") and t.count("[") == t.count("]") and t.count('"') % 2 == 0,
    ]
    return sum(checks) / len(checks)


def components(
    text: str, keywords: list[str], lo: int, hi: int, post: str = ""
) -> dict[str, float]:
    out = {
        "relevance": relevance(text, keywords, post=post),
        "length": length_band(text, lo, hi),
        "tone": tone(text),
        "no_repetition": no_repetition(text),
        "punctuation": punctuation(text),
    }
    good = all(out[k] == 1.0 for k in ("relevance", "length", "tone", "punctuation"))
    ws = words(text)
    out["success"] = float(good and len(ws) - 2 - round(out["no_repetition"] * (len(ws) - 2)) <= 1)
    return out


def reward_batch(tasks: list, groups: list[list[str]]) -> list[list[dict]]:
    """Every reply's components; `diversity` compares the replies within each group."""
    out = []
    for task, group in zip(tasks, groups):
        p = task.payload
        div = [1.0 - b for b in self_bleu_each(group)] or [1.0] * len(group)
        scored = []
        for text, d in zip(group, div):
            c = components(text, p["keywords"], p["min_words"], p["max_words"], p.get("post", ""))
            on_topic = c["relevance"] == 1.0 and c["length"] == 1.0
            scored.append({**c, "diversity": d if on_topic else 0.0})
        out.append(scored)
    return out


def reward(task, completion: str) -> dict:
    """Components of one reply alone (diversity 1: there is no group to compare with)."""
    return reward_batch([task], [[completion]])[0][0]
