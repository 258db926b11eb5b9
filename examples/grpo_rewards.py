"""A reward of your own for examples/grpo.yaml, named there as `examples.grpo_rewards:word_credit`.

A reward function takes the batch and returns one number per completion (None counts as 0):
`prompts` and `completions` are texts, `completion_ids` the sampled tokens, and every other column
of the prompt rows comes as a keyword (here `answer` and `messages`), one value per completion."""


def word_credit(prompts, completions, completion_ids, **columns):
    """Partial credit on the way to the exact answer, for an answer of one word: half for a word at
    all (the tiny model's vocabulary is larger than its tokenizer's), the other half for one of the
    words the prompt lists (the right one or not); `exact_answer` then tells the right one."""
    scores = []
    for prompt, completion in zip(prompts, completions):
        listed = set(prompt.split("<|im_start|>user")[-1].split("<|im_end|>")[0].split()[1:])
        words = completion.split()
        scores.append(0.5 * (len(words) == 1) + 0.5 * (len(words) == 1 and words[0] in listed))
    return scores
