"""Diversity of a set of texts: Self-BLEU and distinct-n.

Self-BLEU (Zhu et al., 2018, Texygen): each text's BLEU against the others as references,
averaged; 0 when the samples share no n-grams, 1 when they are identical. Sentence BLEU
is sacrebleu's (`effective_order=True`, its default exponential smoothing), scaled to
[0, 1]. Used as a reward component inside a group (rewards/replies.py) and reported by
`python -m mlx_grpo.compare`.
"""

from __future__ import annotations

from sacrebleu.metrics import BLEU

_BLEU = BLEU(effective_order=True)


def self_bleu_each(texts: list[str]) -> list[float]:
    """Each text's BLEU in [0, 1] against all the others; [] for fewer than 2 texts.

    >>> self_bleu_each(["the cat sat", "the cat sat"])
    [1.0, 1.0]
    >>> [round(x, 2) for x in self_bleu_each(["the cat sat", "dogs bark loudly"])]
    [0.0, 0.0]
    """
    if len(texts) < 2:
        return []
    out = []
    for i, t in enumerate(texts):
        refs = texts[:i] + texts[i + 1 :]
        out.append(min(1.0, _BLEU.sentence_score(t, refs).score / 100.0) if t.strip() else 1.0)
    return out


def self_bleu(texts: list[str]) -> float:
    """Mean Self-BLEU of a set of texts (0.0 for fewer than two)."""
    each = self_bleu_each(texts)
    return sum(each) / len(each) if each else 0.0


def distinct_n(texts: list[str], n: int = 2) -> float:
    """Distinct n-grams over all n-grams of the texts (whitespace words, lower-cased).

    >>> distinct_n(["a b c", "a b d"], 2)
    0.75
    """
    grams = [
        tuple(w[i : i + n])
        for t in texts
        for w in [t.lower().split()]
        for i in range(len(w) - n + 1)
    ]
    return len(set(grams)) / len(grams) if grams else 0.0
