"""A reward of your own for examples/grpo.yaml, named there as `examples.grpo_rewards:word_credit`.

A reward function takes the batch and returns one number per completion (None counts as 0):
`prompts` and `completions` are texts, `completion_ids` the sampled tokens, and every other column
of the prompt rows comes as a keyword (here `answer` and `messages`), one value per completion."""


def word_credit(prompts, completions, completion_ids, **columns):
    """Partial credit on the way to the exact answer: half for the share of the sampled tokens
    that are words at all (the tiny model's vocabulary is larger than its tokenizer's), half for
    the share that are words of the list the prompt gives."""
    scores = []
    for prompt, completion, ids in zip(prompts, completions, completion_ids):
        listed = set(prompt.split("<|im_start|>user")[-1].split("<|im_end|>")[0].split()[1:])
        words = completion.split()
        scores.append((0.5 * len(words) + 0.5 * sum(w in listed for w in words)) / max(1, len(ids)))
    return scores
