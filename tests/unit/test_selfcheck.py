"""The start-up self-check refuses weights that cannot work: non-finite prefill logits, or a degenerate
distribution (all logits equal) with every greedy token the same id, each in one line naming the likely cause;
working weights pass.  A scripted runner stands in for the model (the check only reads its logits and tokens)."""
from __future__ import annotations

import pytest
import torch

from qwen_chat.engine.startup.selfcheck import SELF_CHECK_TOKENS, SelfCheckError, run_self_check
from qwen_chat.engine.types import NONFINITE_TOKEN


class _Tokenizer:
    def encode(self, text: str) -> list[int]:
        return [1, 2, 3]


class _Runner:
    vocab_size = 16

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits

    def prefill(self, slot, prompt) -> torch.Tensor:
        return self.logits.clone()

    def free(self, slot) -> None:
        pass


class _Executor:
    """Greedy over the runner's fixed logits (NaN reads as the lowest id, as argmax over NaN gives on the GPU)."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.runner = _Runner(logits)

    def execute(self, plan):
        clean = torch.nan_to_num(self.runner.logits, nan=-1.0)
        return {0: int(clean.argmax())}


def test_working_logits_pass():
    logits = torch.linspace(-5, 5, 16)
    result = run_self_check(_Executor(logits), _Tokenizer())
    assert result["tokens"] == [15] * SELF_CHECK_TOKENS and result["checksum"] == pytest.approx(0.0, abs=1e-6)


def test_non_finite_logits_are_refused_naming_corrupt_weights():
    logits = torch.linspace(-5, 5, 16)
    logits[3] = float("nan")
    logits[7] = float("inf")
    with pytest.raises(SelfCheckError, match=r"2 non-finite logit\(s\) .* of 16: the weights are likely corrupt"):
        run_self_check(_Executor(logits), _Tokenizer())


def test_a_degenerate_distribution_with_one_repeated_token_is_refused():
    with pytest.raises(SelfCheckError, match="logits are all equal .* every greedy token is id 0"):
        run_self_check(_Executor(torch.zeros(16)), _Tokenizer())


def test_non_finite_logits_of_a_decode_step_are_refused_and_never_fed_back():
    class FaultyDecode(_Executor):
        """Finite prefill logits, but the executor reports the third greedy token's logits as non-finite
        (``NONFINITE_TOKEN``, as ``LocalExecutor.collect`` does)."""

        fed: list = []

        def execute(self, plan):
            if plan.free_slots:
                self.fed.append("free")
                return {}
            self.fed.extend(plan.decode_tokens)
            return {0: NONFINITE_TOKEN if len(self.fed) == 2 else 15}

    executor = FaultyDecode(torch.linspace(-5, 5, 16))
    with pytest.raises(SelfCheckError, match=r"non-finite logits \(NaN or infinity\) for its greedy token 3: "
                                             "the weights are likely corrupt"):
        run_self_check(executor, _Tokenizer())
    assert executor.fed == [15, 15, "free"]  # slot 0 freed, the marker never decoded
