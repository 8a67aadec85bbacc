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


# ------------------------------------------------------- the agent model

THINK, END_THINK, CALL, END_CALL = "<think>", "</think>", "<tool_call>", "</tool_call>"
#: One token whose text is a whole tool call in the json_tools format.
CALL_BODY = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
REASONING, ANSWER = "pondering", "Sunny"
#: A chat template in Qwen's style: tools as JSON in a system block, calls
#: between <tool_call> markers (mlx-lm reads its json_tools parser from
#: `tool_call.name`), thinking switched off by `enable_thinking=false`.
AGENT_TEMPLATE = (
    "{% if tools %}<|system|># Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}"
    "</tool_call>{% endfor %}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
    "{# tool_call.name #}"
)


def build_agent_model_dir(path: Path, seed: int = 5) -> Path:
    """A tiny model for the agent API: its output depends on the current
    token only (every layer's output projection is zero, so the hidden state
    is the token's embedding), and its head is built so that

    * after any ordinary token, the tokens made only of `"`, `}`, `]`, `,` are
      far more likely than the rest (a grammar then closes its JSON within a
      few tokens, where a random model keeps a string open for hundreds);
    * `<tool_call>` -> the call body -> `</tool_call>` -> end of text, and
      `<think>` -> "pondering" -> `</think>` -> "Sunny" -> end of text, each
      by a margin larger than a logit bias of 100: a bias on the first token
      of a chain forces the whole chain.
    """
    from tokenizers import AddedToken

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(path)
    chain = [THINK, REASONING, END_THINK, ANSWER, CALL, CALL_BODY, END_CALL]
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in chain])
    tokenizer.chat_template = AGENT_TEMPLATE
    tokenizer.save_pretrained(str(path))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in chain}
    eos = tokenizer.convert_tokens_to_ids(EOS)
    vocab = len(tokenizer)
    hidden = 64
    config = {
        "model_type": "llama", "hidden_size": hidden, "num_hidden_layers": 2,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    num_chain = len(chain)
    shared = mx.zeros((hidden,)).at[num_chain:].add(1.0)  # the ordinary tokens' direction
    noise = mx.random.normal((vocab, hidden)) * 0.3
    embed = (shared + noise) * mx.array([0.0] * num_chain + [1.0] * (hidden - num_chain))
    head = mx.random.normal((vocab, hidden)) * 0.1
    head = head * mx.array([0.0] * num_chain + [1.0] * (hidden - num_chain))
    closers = [t for t in range(vocab)
               if (text := tokenizer.decode([t])) and set(text) <= set('"}],')]
    for t in closers:  # logit about 14 after an ordinary token (11 for a comma: fewer items)
        head = head.at[t].add(shared * (0.2 if "," in tokenizer.decode([t]) else 0.25))
    successors = [ids[REASONING], ids[END_THINK], ids[ANSWER], eos, ids[CALL_BODY],
                  ids[END_CALL], eos]
    for k, (token, after) in enumerate(zip(chain, successors)):
        embed = embed.at[ids[token]].add(-embed[ids[token]])  # one direction of its own
        embed = embed.at[ids[token], k].add(1.0)
        head = head.at[after, k].add(40.0)  # logit 8 x 40 = 320 after `token`
    model.model.embed_tokens.weight = embed
    model.lm_head.weight = head
    mx.eval(model.parameters())
    save_model(path, model)
    save_config(config, path / "config.json")
    return path
