"""Text in and out of the engine: prompts from text or chat messages,
streamed detokenized text, stop strings.

`TextCodec` wraps an mlx-lm `TokenizerWrapper` (what `mlx_lm.load` gives):
`encode(prompt)` turns text (special tokens added, as mlx-lm's `generate`)
or chat messages (the tokenizer's chat template, with the generation
prompt) into token ids. `SampleText` follows one sample: every new token
goes through an `IncrementalDetokenizer`, and the text is released only
up to where no stop string could still begin, so a streamed delta never
holds part of a stop string (OpenAI's behaviour: the text is cut before the
stop string, which is not returned). Stop strings are searched by one
automaton per request (`StopStrings`): O(1) per new character whatever
their number. A token in `stop_token_ids` (the end of sequence) ends the
sample and adds no text.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
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


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat with what its template renders besides the messages: `tools`
    (OpenAI's tool objects, given to the template as `tools`) and
    `template_kwargs` (e.g. {"enable_thinking": False}, given as keywords)."""

    messages: Messages
    tools: Sequence[Mapping[str, Any]] | None = None
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)


#: Template keywords the engine sets itself.
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "tokenize",
                                       "add_generation_prompt", "return_dict"})


def is_text_prompt(prompt: object) -> bool:
    """Is `prompt` text or chat messages (rather than token ids)?"""
    if isinstance(prompt, (str, ChatPrompt)):
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
        empty text, text that is not valid Unicode (a lone surrogate, which
        JSON can carry), malformed messages, or a chat without a template."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgument("prompt is an empty string")
            check_unicode(prompt, "prompt")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, ChatPrompt):
            return self.encode_chat(prompt.messages, prompt.tools, prompt.template_kwargs)
        return self.encode_chat(prompt)

    def encode_chat(self, messages: Messages, tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The chat template's tokens for `messages` with the generation
        prompt; `tools` and `template_kwargs` as `ChatPrompt` has them."""
        check_messages(messages)
        if not self.tokenizer.has_chat_template:
            raise InvalidArgument("this model's tokenizer has no chat template")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(kwargs))
        if reserved:
            raise InvalidArgument(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if tools:
            kwargs["tools"] = [dict(t) for t in tools]
        from jinja2 import TemplateError

        try:
            tokens = self.tokenizer.apply_chat_template(
                [dict(m) for m in messages], add_generation_prompt=True, tokenize=True, **kwargs
            )
        except TemplateError as error:  # the template refused the chat (roles, order)
            raise InvalidArgument(f"the chat template refused these messages: {error}") from None
        return list(tokens)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def sample_text(self, stop: StopStrings | Sequence[str], stop_token_ids: Sequence[int],
                    prompt: Sequence[int] = ()) -> SampleText:
        """A sample's text; `stop` a request's `StopStrings` (shared by its
        samples) or its stop strings."""
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt[-PROMPT_CONTEXT:])
        return SampleText(detokenizer, stop, frozenset(stop_token_ids))


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


def check_unicode(text: str, what: str) -> None:
    """`InvalidArgument` unless `text` can be encoded as UTF-8 (no lone
    surrogate): a tokenizer cannot encode it. O(len(text)) at C speed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidArgument(
            f"{what} is not valid Unicode: {error.reason} at character {error.start}"
        ) from None


def check_messages(messages: object) -> None:
    """A non-empty list of {"role": str, "content": str | list | None} maps,
    their strings valid Unicode."""
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
        check_unicode(role, f"messages[{index}].role")
        for part in [content] if isinstance(content, str) else content or ():
            text = part.get("text") if isinstance(part, Mapping) else part
            if isinstance(text, str):
                check_unicode(text, f"messages[{index}].content")


class StopStrings:
    """A request's stop strings as one Aho-Corasick automaton over
    characters, built once per request and shared by its samples.

    `advance(state, text)` feeds text from a state (0: nothing read) and
    returns the new state and the start of the earliest stop string that
    ends inside `text` (None: none does); `held_back(state)` is how many of
    the last characters read begin some stop string. Feeding a character
    costs O(1) amortized, whatever the number of stop strings (a search of
    each string at each token costs O(count x longest)). Building costs
    O(total characters)."""

    __slots__ = ("strings", "_goto", "_fail", "_depth", "_match")

    def __init__(self, strings: Sequence[str]) -> None:
        self.strings = tuple(strings)
        goto: list[dict[str, int]] = [{}]
        depth, match = [0], [0]  # match: the longest stop string ending at the state
        for text in self.strings:
            node = 0
            for char in text:
                child = goto[node].get(char)
                if child is None:
                    child = goto[node][char] = len(goto)
                    goto.append({})
                    depth.append(depth[node] + 1)
                    match.append(0)
                node = child
            match[node] = len(text)
        fail = [0] * len(goto)
        queue = deque(goto[0].values())
        while queue:  # breadth first: a state's fallback is shallower, set before it
            node = queue.popleft()
            for char, child in goto[node].items():
                back = fail[node]
                while back and char not in goto[back]:
                    back = fail[back]
                target = goto[back].get(char, 0)
                fail[child] = target if target != child else 0
                match[child] = match[child] or match[fail[child]]
                queue.append(child)
        self._goto, self._fail, self._depth, self._match = goto, fail, depth, match

    def __bool__(self) -> bool:
        return bool(self.strings)

    def advance(self, state: int, text: str, offset: int = 0) -> tuple[int, int | None]:
        """Feed `text` (whose first character is at `offset` of the whole
        text); returns (state, earliest start of a stop string ending in it)."""
        goto, fail, match = self._goto, self._fail, self._match
        cut = None
        for i, char in enumerate(text):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            if match[state]:
                start = offset + i - match[state] + 1
                if cut is None or start < cut:
                    cut = start
        return state, cut

    def held_back(self, state: int) -> int:
        """Characters at the end of the text read that begin a stop string."""
        return self._depth[state]


@functools.lru_cache(maxsize=64)
def stop_strings(stop: tuple[str, ...]) -> StopStrings:
    """The automaton of `stop`, shared by the requests that give the same
    strings (`functools.lru_cache` is thread-safe, so a server can build it
    off the engine thread before it queues the request)."""
    return StopStrings(stop)


class SampleText:
    """The text of one sample, released as deltas (see the module doc).

    `add(token)` returns the new text that is safe to show; `stopped` is
    set once a stop string was found (the text is then final). `stop` is a
    request's `StopStrings` (or the strings, built here). Cost per token:
    the detokenizer's, plus O(new characters) for the stop strings."""

    __slots__ = ("_detok", "_stop", "_stop_ids", "_state", "_released", "_searched",
                 "stopped", "text")

    def __init__(self, detokenizer: Any, stop: StopStrings | Sequence[str],
                 stop_ids: frozenset[int]):
        self._detok = detokenizer
        self._stop = stop if isinstance(stop, StopStrings) else StopStrings(stop)
        self._stop_ids = stop_ids
        self._state = 0  # the stop automaton's state after the text searched
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
            self._state, cut = self._stop.advance(self._state, full[self._searched :],
                                                  self._searched)
            self._searched = len(full)
            if cut is not None:
                self.stopped = True
                end = cut
            elif not final:
                end -= self._stop.held_back(self._state)
        if end <= self._released:
            return ""
        delta = full[self._released : end]
        self._released = end
        self.text += delta
        return delta
