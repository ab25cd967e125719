"""The requests a run serves, drawn from the run's random generator: a prompt and an output,
where a prompt may start with one of a few shared system prompts or continue a recently
finished conversation (what makes the prefix cache hit)."""

from __future__ import annotations

import numpy as np

from .config import SynthConfig

# Finished conversations a follow-up request may continue.
RECENT_CONVERSATIONS = 64


class Workload:
    def __init__(self, config: SynthConfig, rng: np.random.Generator):
        self.config = c = config
        self.rng = rng
        self.finished: list = []
        self.system_prompts = [
            self.tokens(int(rng.integers(c.shared_prefix_len[0], c.shared_prefix_len[1] + 1)))
            for _ in range(c.shared_prefixes)]

    def tokens(self, n: int) -> np.ndarray:
        return self.rng.integers(1, self.config.vocab, size=n, dtype=np.int64).astype(np.int32)

    def next_request(self) -> tuple:
        """``(prompt, output)`` token arrays of the next request."""
        c, rng = self.config, self.rng
        prompt = self.tokens(int(rng.integers(c.prompt_len[0], c.prompt_len[1] + 1)))
        output = self.tokens(int(rng.integers(c.output_len[0], c.output_len[1] + 1)))
        roll = rng.random()
        if roll < c.followup_prob and self.finished:
            parent = self.finished[int(rng.integers(len(self.finished)))]
            if parent.shape[0] + prompt.shape[0] + output.shape[0] <= c.max_context_len:
                return np.concatenate([parent, prompt]), output
        if roll < c.followup_prob + c.share_prob and self.system_prompts:
            system = self.system_prompts[int(rng.integers(len(self.system_prompts)))]
            return np.concatenate([system, prompt]), output
        return prompt, output

    def conversation_finished(self, tokens: np.ndarray) -> None:
        self.finished.append(tokens.copy())
        if len(self.finished) > RECENT_CONVERSATIONS:
            self.finished.pop(0)
