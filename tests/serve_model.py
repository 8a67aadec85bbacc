"""A tiny model directory in mlx-lm's format, built locally (no download).

`build_model_dir(path)` trains a byte-level BPE tokenizer on a few sentences
with the `tokenizers` library, saves it with a chat template and an
end-of-text token, builds a random-weight llama (float32) whose vocabulary
is the tokenizer's, and saves weights and config as `mlx_lm.load` expects.
Used by the text, sampling and server tests.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.utils import save_config, save_model

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% if messages[0]['role'] == 'tool' %}"
    "{{ raise_exception('a chat cannot start with a tool message') }}{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the cache in fixed size blocks.",
    "A prefix trie shares the system prompt between requests.",
    "Hello world, hello server, hello client!",
    "Streams of tokens become streams of text.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols: {} [] () <> | , ; .",
]


def build_tokenizer(path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return fast


def build_model_dir(path: Path, seed: int = 3, context: int | None = None,
                    head_dim: int | None = None, shape: dict | None = None) -> Path:
    """Write a tiny llama + tokenizer into `path`; returns `path`.
    `context`: the config's max_position_embeddings (None: not given).
    `head_dim`: the attention head size (None: hidden size / heads = 16,
    which no quantization group size divides; 32 takes groups of 32).
    `shape`: config fields that replace the tiny ones."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    config = {
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": len(tokenizer), "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    if context is not None:
        config["max_position_embeddings"] = context
    if head_dim is not None:
        config["head_dim"] = head_dim
    config.update(shape or {})
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    # Larger output weights than the default init: the logits then spread
    # enough that greedy outputs vary with the prompt (stop strings, top-k).
    model.lm_head.weight = mx.random.normal(model.lm_head.weight.shape) * 0.5
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path


def load_tiny(path: Path):
    """(model, tokenizer) of a directory written by `build_model_dir`."""
    import mlx_lm

    return mlx_lm.load(str(path))


def greedy_reference(model, prompt: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own greedy decode (its `generate_step`, its KV caches)."""
    from mlx_lm.generate import generate_step

    tokens = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        tokens.append(int(token))
    return tokens
