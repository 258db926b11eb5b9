"""What the in-process GRPO tests share: a reward a tiny model can learn, and token prompts'
completions as text."""


def low_tokens(prompts, completions, completion_ids, **columns):
    """The fraction of a completion's tokens below 32 (an eighth of tiny-llama's vocabulary)."""
    return [sum(t < 32 for t in ids) / len(ids) for ids in completion_ids]


class TokenIds:
    """Completions of token prompts as their ids written out; no EOS ends them."""

    eos_id = None

    def completion_text(self, ids):
        return " ".join(map(str, ids))
