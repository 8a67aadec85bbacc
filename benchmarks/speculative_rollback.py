"""The recurrent rollback's cost, counted: target positions computed again
after a rejected draft restored a hybrid sequence's checkpoint, per
generated token, against the acceptance rate.

Run: python benchmarks/speculative_rollback.py

The test-sized lfm2, qwen3_next and recurrent_gemma (recurrent + sliding
window 16; tests/tiny_models.py) with drafts that
are noisy copies of the target (more noise: less agreement), k = 3, 8
prompts of 2..69 tokens, 32 new tokens each, greedy. Counts, not timings:
they do not depend on the machine.
"""

from __future__ import annotations

from scheduler import Engine, SamplingParams
from tests.scheduler.test_engine import make_prompts
from tests.scheduler.test_speculative import noisy_copy
from tests.tiny_models import HYBRID_VOCAB, built


def main() -> None:
    print("| model | draft noise | acceptance | target forwards | recomputed "
          "| recomputed / generated |")
    print("|---|---|---|---|---|---|")
    prompts = make_prompts(HYBRID_VOCAB)[:8]
    for name in ("lfm2", "qwen3_next", "recurrent_gemma"):
        for noise in (0.005, 0.05, 0.2, 3.0):
            engine = Engine(built(name), num_blocks=256, block_size=8, max_num_seqs=8,
                            draft_model=noisy_copy(name, noise), num_speculative_tokens=3)
            outs = engine.generate(prompts, SamplingParams(max_tokens=32))
            stats = engine.stats
            generated = sum(len(o.tokens) for o in outs)
            print(f"| {name} | {noise} | {stats.acceptance_rate:.2f} | {stats.num_forwards} | "
                  f"{stats.num_recomputed_tokens} | "
                  f"{stats.num_recomputed_tokens / generated:.2f} |")


if __name__ == "__main__":
    main()
