"""How an RL stage samples its rollouts (`algo.grpo.temperature`, `top_p`, `top_k`,
`max_new_tokens`), as one group.

Why a group: these four settings decide what the engine draws, and the temperature also decides
what the trainer scores (the loss's log-probs use it). Spread over the stage driver, the config
check and the trainer, a check or a translation gets missed in one place. `SamplingConfig` holds
them, checks itself once (`sampling_problems`), and turns them into the request the stage sends
(`sampling_params`). `algo.grpo` extends it (GRPOAlgoConfig), so the keys stay
`algo.grpo.temperature`, ...; the stage passes its config whole.

ptrain/config imports nothing above itself and no JAX (tests/test_layering.py), so the request
is SGLang's plain `sampling_params` object, which the rollout protocol parses and checks:
`SamplingParams.from_dict(cfg.sampling_params())` (ptrain/rollout/protocol.py).

The check method has its own name (not `problems`): GRPOAlgoConfig inherits this group, the
advantage group and PolicyLossConfig together, and a shared method name would resolve to just
one of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Sampling temperature (> 0); the trainer's log-probs use the same one."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]. Anything below 1 makes the sampling distribution differ
    from the tempered softmax the loss uses; the engine's full-vocabulary log-probs keep the
    importance ratio right, but recipes leave it at 1."""
    top_k: int = 0
    """Top-k sampling (0: off)."""
    max_new_tokens: int = 96
    """Longest response per turn, in tokens (> 0, and below train.seq_len, which holds prompt
    and response: the default leaves 32 prompt tokens within the default seq_len of 128)."""

    def sampling_problems(self) -> list[tuple[str, str]]:
        """Every impossible value, as (field, what is wrong and what to pass). The config check
        reports each under `algo.grpo.<field>`; a message reads after the key name."""
        out: list[tuple[str, str]] = []
        if not self.temperature > 0:
            out.append(("temperature", f"must be > 0, got {self.temperature}"))
        elif not math.isfinite(self.temperature):  # inf passes > 0 but makes the sampling uniform
            out.append(("temperature", f"must be a finite number, got {self.temperature}"))
        if not 0 < self.top_p <= 1:
            out.append(("top_p", f"must be in (0, 1], got {self.top_p}"))
        if not self.top_k >= 0:
            out.append(("top_k", f"must be >= 0 (0: off), got {self.top_k}"))
        if not self.max_new_tokens > 0:
            out.append(("max_new_tokens", f"must be > 0, got {self.max_new_tokens}"))
        return out

    def sampling_params(self) -> dict[str, Any]:
        """SGLang's `sampling_params` object for these settings (plain JSON values).

        top_k 0 ("off" here) is left out: SGLang's default already keeps every token, and
        SGLang refuses 0 ("top_k must be -1 (disable) or at least 1"). The in-process engine
        reads 0 and the default alike. The number of samples (`n`, the group size) is the
        rollout collector's to set.
        """
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.top_k > 0:
            out["top_k"] = self.top_k
        return out
