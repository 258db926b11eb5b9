"""What the executor tells an observer as a step runs: each weight copy into a slot, each compute
that reads one, each slot released, each gradient sent. The default hears nothing; tests subclass
it to check the executor's ordering rules (a copy never overwrites weights a pending compute still
reads, every layer's gradient leaves once) without a GPU."""

from __future__ import annotations


class StepHooks:
    def copy(self, slot: int, layer: int, waited_for) -> None:
        """The copy of `layer`'s weights into `slot` is queued, after the event `waited_for` (the
        last compute that read the slot; None when nothing had)."""

    def compute(self, slot: int, layer: int) -> None:
        """A compute that reads `slot` (holding `layer`) is about to be queued."""

    def free(self, slot: int, layer: int, freed) -> None:
        """The computes reading `slot` are queued; the event `freed` marks their end."""

    def gradient(self, layer: int) -> None:
        """`layer`'s gradient is on its way to the host."""


NO_HOOKS = StepHooks()
