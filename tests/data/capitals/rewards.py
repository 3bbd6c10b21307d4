def correct(completions, answer, **kwargs):
    """TRL's signature: every completion of the step at once; `answer` is a JSONL field."""
    return [float(a.lower() in c.lower()) for c, a in zip(completions, answer)]


def brevity(task, completion):
    """mlx-grpo's signature: one task and one completion."""
    return 1.0 if len(completion.split()) <= 5 else 0.0
