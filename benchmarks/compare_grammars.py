"""llguidance against xgrammar for `response_format` (one run, same tokenizer).

For each library: (1) correctness on the JSON-Schema features OpenAI's strict
mode allows (nested objects, arrays, enums, `anyOf`, nullable type lists,
`$defs`/`$ref`, recursion, `additionalProperties: false`): a random walk
draws tokens the library's mask allows, ending when it allows only EOS (at
most `--max-tokens`); the text must parse and validate (`jsonschema`); (2)
the time to build a matcher (schema compile included), and per token the
time to compute the mask and consume the token, over the walks.

The tokenizer is a byte-level BPE of `--vocab` tokens trained on Python's
standard library source (no download): a vocabulary the size of a real
model's is what mask cost depends on.

    python benchmarks/compare_grammars.py [--vocab 32000] [--walks 10]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import sysconfig
import time

import numpy as np

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["name", "age", "ok"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "ccc"]}},
        "score": {"type": "number"}},
        "required": ["tags", "score"], "additionalProperties": False},
    "nullable_anyof": {"type": "object", "properties": {
        "x": {"type": ["string", "null"]},
        "y": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
            "z": {"type": "boolean"}}, "required": ["z"], "additionalProperties": False}]}},
        "required": ["x", "y"], "additionalProperties": False},
    "defs_recursive": {"type": "object", "$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["v", "kids"], "additionalProperties": False}},
        "properties": {"root": {"$ref": "#/$defs/node"}}, "required": ["root"],
        "additionalProperties": False},
}


def train_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


class Llg:
    name = "llguidance"

    def __init__(self, hf, vocab):
        import llguidance
        import llguidance.hf

        self.lib = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.words = (vocab + 31) // 32

    def matcher(self, schema):
        grammar = self.lib.LLMatcher.grammar_from_json_schema(schema)
        return self.lib.LLMatcher(self.tok, grammar, log_level=0)

    def mask(self, m):
        out = np.zeros(self.words, dtype=np.int32)
        m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    def consume(self, m, t):
        if not m.consume_token(t):
            raise RuntimeError(m.get_error())


class Xgr:
    name = "xgrammar"

    def __init__(self, hf, vocab):
        import xgrammar

        self.lib = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)

    def matcher(self, schema):
        return self.lib.GrammarMatcher(self.compiler.compile_json_schema(
            json.dumps(schema), strict_mode=True, any_whitespace=False))

    def mask(self, m):
        m.fill_next_token_bitmask(self.bitmask)
        return self.bitmask[0].numpy()

    def consume(self, m, t):
        if not m.accept_token(t):
            raise RuntimeError("token refused")


def walk(lib, schema, eos, vocab, rng, max_tokens):
    t0 = time.perf_counter()
    m = lib.matcher(schema)
    build = time.perf_counter() - t0
    tokens, times = [], []
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        bits = lib.mask(m)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little")[:vocab])
        times.append(time.perf_counter() - t0)
        if len(allowed) == 0 or (len(allowed) == 1 and allowed[0] == eos):
            break
        # prefer the tokens that close JSON, as a model trained on it would
        choices = [int(t) for t in allowed if t != eos]
        token = rng.choice(choices)
        t0 = time.perf_counter()
        lib.consume(m, token)
        times[-1] += time.perf_counter() - t0
        tokens.append(token)
    return build, tokens, times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--walks", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    import jsonschema

    hf = train_tokenizer(args.vocab)
    vocab = len(hf)
    eos = hf.eos_token_id
    print(f"tokenizer: {vocab} tokens")
    for cls in (Llg, Xgr):
        t0 = time.perf_counter()
        lib = cls(hf, vocab)
        print(f"\n{cls.name}: tokenizer setup {time.perf_counter() - t0:.2f} s")
        for name, schema in SCHEMAS.items():
            rng = random.Random(0)
            builds, per_token, valid, complete = [], [], 0, 0
            for _ in range(args.walks):
                try:
                    build, tokens, times = walk(lib, schema, eos, vocab, rng, args.max_tokens)
                except Exception as error:  # noqa: BLE001 - a library failure is a result
                    print(f"  {name}: error {type(error).__name__}: {error}"[:200])
                    break
                builds.append(build)
                per_token.extend(times)
                text = hf.decode(tokens)
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                    complete += 1
                except json.JSONDecodeError:
                    pass  # still open at max_tokens: not wrong, not finished
                except jsonschema.ValidationError as error:
                    print(f"  {name}: INVALID {text[:120]!r}: {error.message[:100]}")
            if builds:
                print(f"  {name:15s} valid {valid}/{args.walks}  build "
                      f"{1e3 * statistics.median(builds):7.2f} ms  mask+consume "
                      f"{1e6 * statistics.median(per_token):7.1f} us/token (median), "
                      f"{1e6 * statistics.mean(per_token):7.1f} mean")


if __name__ == "__main__":
    main()
