"""Per-token cost of constrained decoding in a batched decode step.

A batch of B requests (8, 32) decodes side by side on one `Engine`; in one
run none is constrained, in the other one row carries a grammar (a JSON
string schema: a random-weight model keeps the string open, so the grammar
is live at every step). Runs alternate (none then one, one then none, ...) so
that the machine's load falls on both alike; reported: the median time per
generated token of each and their ratio. On a loaded machine the step's
own noise is larger than the grammar's cost, so the sampler is also timed
alone, side by side: `sample_rows` over a ``[B, V]`` logits batch without
masks, and with one row's mask (its matcher's `allowed()` included).

The model is a random llama (hidden 256, 4 layers, float32) over a byte-level
BPE of 32k tokens trained on Python's standard library (no download): the
mask's cost grows with the vocabulary, the step's with the model.

    python benchmarks/constrained_step.py [--batches 8 32] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama

from benchmarks.compare_grammars import train_tokenizer
from scheduler.core.request import SamplingParams
from scheduler.engine.engine import Engine


def build(vocab: int):
    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4,
              "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
              "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
              "tie_word_embeddings": False}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def run(engine, batch, constrained, tokens, grammar) -> float:
    """Seconds per generated token of one batch run (prefill excluded: the
    clock starts at the first decode step)."""
    plain = SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True)
    params = [plain] * batch
    if constrained:
        params = [SamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True,
                                 constraint=grammar)] + params[1:]
    for k, p in enumerate(params):
        engine.add_request([1 + k, 2, 3, 4], p)
    engine.step()  # the prefills
    start, generated = time.perf_counter(), 0
    while engine.has_unfinished():
        generated += sum(len(t) for out in engine.step() for t in out.new_tokens.values())
    return (time.perf_counter() - start) / generated


def sampler_cost(batch: int, vocab: int, grammar, quote: int,
                 repeats: int = 200) -> tuple[float, float]:
    """Median seconds of one sampling call over `batch` rows: no mask, and
    one row's mask computed by its matcher (a string kept open) and applied."""
    from scheduler.engine.sampling import KeyChain, sample_rows

    logits = mx.random.normal((batch, vocab))
    params = [SamplingParams(temperature=1.0)] * batch
    keys: list[KeyChain | None] = [None] * batch
    matcher = grammar.new_matcher()
    output = [quote]  # the string is open: every string token is allowed
    mx.eval(logits)
    plain, masked = [], []
    for k in range(repeats):
        for with_mask in ((False, True) if k % 2 == 0 else (True, False)):
            start = time.perf_counter()
            masks = None
            if with_mask:
                masks = [matcher.allowed(output)] + [None] * (batch - 1)
            mx.eval(sample_rows(logits, params, keys, masks=masks))
            (masked if with_mask else plain).append(time.perf_counter() - start)
    return statistics.median(plain), statistics.median(masked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = train_tokenizer(32000)
    tokenizer = TokenizerWrapper(hf)
    model = build(len(hf))
    print(f"vocabulary {len(hf)}, model hidden 256 x 4 layers, float32, "
          f"{args.tokens} tokens per request")
    for batch in args.batches:
        engine = Engine(model, num_blocks=batch * 8 + 16, block_size=16, tokenizer=tokenizer,
                        max_num_seqs=batch, batch_probe=False)
        grammar = engine.grammars.json_schema({"type": "string"})
        run(engine, batch, True, 4, grammar)  # warm up (llguidance's tokenizer, kernels)
        times: dict[bool, list[float]] = {False: [], True: []}
        for k in range(args.repeats):  # alternate which goes first
            for constrained in ((False, True) if k % 2 == 0 else (True, False)):
                times[constrained].append(run(engine, batch, constrained, args.tokens, grammar))
        none, one = statistics.median(times[False]), statistics.median(times[True])
        print(f"batch {batch:3d}: none constrained {1e3 * none:7.3f} ms/token, one row "
              f"constrained {1e3 * one:7.3f} ms/token, ratio {one / none:5.3f}")
        plain, masked = sampler_cost(batch, len(hf), grammar, hf.convert_tokens_to_ids('"'))
        print(f"           sampler alone: {1e3 * plain:6.3f} ms per step without a mask, "
              f"{1e3 * masked:6.3f} ms with one row's mask (+{1e3 * (masked - plain):.3f} ms "
              f"per step, ratio {masked / plain:5.3f})")


if __name__ == "__main__":
    main()
