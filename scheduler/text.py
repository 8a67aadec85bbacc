"""Text in and out of the engine: prompts from text or chat messages,
streamed detokenized text, stop strings.

`TextCodec` wraps an mlx-lm `TokenizerWrapper` (what `mlx_lm.load` gives):
`encode(prompt)` turns text (special tokens added, as mlx-lm's `generate`)
or chat messages (the tokenizer's chat template, with the generation
prompt) into token ids. `SampleText` follows one sample: every new token
goes through an `IncrementalDetokenizer`, and the text is released only
up to where no stop string could still begin, so a streamed delta never
holds part of a stop string (OpenAI's behaviour: the text is cut before the
stop string, which is not returned). A token in `stop_token_ids` (the end of
sequence) ends the sample and adds no text.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from blockmgr.errors import InvalidArgument, WrongArgumentType

#: A chat: [{"role": ..., "content": ...}, ...].
Messages = Sequence[Mapping[str, Any]]


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine uses of a tokenizer: mlx-lm's `TokenizerWrapper`
    (what `mlx_lm.load` gives) has all of it."""

    eos_token_ids: Collection[int]
    has_chat_template: bool

    def encode(self, text: str) -> list[int]: ...
    def decode(self, tokens: list[int]) -> str: ...
    def apply_chat_template(self, messages: list, **kwargs: Any) -> list[int]: ...


def is_text_prompt(prompt: object) -> bool:
    """Is `prompt` text or chat messages (rather than token ids)?"""
    if isinstance(prompt, str):
        return True
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], Mapping)


class TextCodec:
    """Prompts to token ids and per-sample text, over one mlx-lm tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        if not isinstance(tokenizer, Tokenizer):
            raise WrongArgumentType(
                f"tokenizer must be an mlx-lm TokenizerWrapper (see text.Tokenizer), "
                f"got {tokenizer!r:.80}"
            )
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(sorted(tokenizer.eos_token_ids))

    def encode(self, prompt: str | Messages) -> list[int]:
        """Token ids of text or chat messages. `InvalidArgument` for an
        empty text, malformed messages, or a chat without a template."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt is an empty string")
            return list(self.tokenizer.encode(prompt))
        return self.encode_chat(prompt)

    def encode_chat(self, messages: Messages) -> list[int]:
        check_messages(messages)
        if not self.tokenizer.has_chat_template:
            raise InvalidArgument("this model's tokenizer has no chat template")
        from jinja2 import TemplateError

        try:
            tokens = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True
            )
        except TemplateError as error:  # the template refused the chat (roles, order)
            raise InvalidArgument(f"the chat template refused these messages: {error}") from None
        return list(tokens)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def sample_text(self, stop: Sequence[str], stop_token_ids: Sequence[int],
                    prompt: Sequence[int] = ()) -> SampleText:
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt[-PROMPT_CONTEXT:])
        return SampleText(detokenizer, tuple(stop), frozenset(stop_token_ids))


#: Prompt tokens an output's detokenizer starts from (see `IncrementalDetokenizer`).
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """The text of a growing token list, equal to `tokenizer.decode` of it.

    Each new token decodes a short window twice: the tokens since the last
    release (`prefix`) and those plus the new ones; the difference is the
    new text, released once it does not end inside a UTF-8 character.
    Starting the window on the prompt's last tokens keeps the first output
    token's leading space, which a tokenizer (SentencePiece, or mlx-lm's
    streaming detokenizers) drops at the start of a text. Cost: two decodes
    of a few tokens per token.
    """

    __slots__ = ("_decode", "_tokens", "_prefix", "_read", "text")

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self._decode = tokenizer.decode
        self._tokens = list(context)
        self._prefix = 0
        self._read = len(self._tokens)
        self.text = ""

    def add_token(self, token: int) -> None:
        self._tokens.append(token)
        self._advance(final=False)

    def finalize(self) -> None:
        self._advance(final=True)

    def _advance(self, final: bool) -> None:
        before = self._decode(self._tokens[self._prefix : self._read])
        after = self._decode(self._tokens[self._prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix = self._read
            self._read = len(self._tokens)


def check_messages(messages: object) -> None:
    """A non-empty list of {"role": str, "content": str | list | None} maps."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise WrongArgumentType(f"messages must be a non-empty list, got {messages!r:.80}")
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise WrongArgumentType(f"messages[{index}] must be an object, got {message!r:.80}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidArgument(f"messages[{index}] needs a 'role' string, got {role!r:.80}")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise WrongArgumentType(
                f"messages[{index}].content must be a string, got {content!r:.80}"
            )


class SampleText:
    """The text of one sample, released as deltas (see the module doc).

    `add(token)` returns the new text that is safe to show; `stopped` is
    set once a stop string was found (the text is then final). Cost per
    token: the detokenizer's, plus a search of the last few characters."""

    __slots__ = ("_detok", "_stop", "_stop_ids", "_longest", "_released", "_searched",
                 "stopped", "text")

    def __init__(self, detokenizer: Any, stop: tuple[str, ...], stop_ids: frozenset[int]):
        self._detok = detokenizer
        self._stop = stop
        self._stop_ids = stop_ids
        self._longest = max((len(s) for s in stop), default=0)
        self._released = 0  # characters of the text handed out
        self._searched = 0  # characters already searched for a stop string
        self.stopped = False
        self.text = ""  # the text handed out so far

    def add(self, token: int) -> str:
        if self.stopped or token in self._stop_ids:
            return ""
        self._detok.add_token(token)
        return self._release(self._detok.text, final=False)

    def finish(self) -> str:
        """The sample ended: release what was held back."""
        if self.stopped:
            return ""
        self._detok.finalize()
        return self._release(self._detok.text, final=True)

    def _release(self, full: str, final: bool) -> str:
        end = len(full)
        if self._stop:
            start = max(0, self._searched - self._longest + 1)
            cut = min((i for i in (full.find(s, start) for s in self._stop) if i >= 0),
                      default=None)
            if cut is not None:
                self.stopped = True
                end = cut
            elif not final:
                end -= _held_back(full, self._stop, self._longest)
            self._searched = len(full)
        if end <= self._released:
            return ""
        delta = full[self._released : end]
        self._released = end
        self.text += delta
        return delta


def _held_back(text: str, stop: tuple[str, ...], longest: int) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    for size in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-size:]
        if any(s.startswith(tail) for s in stop):
            return size
    return 0
