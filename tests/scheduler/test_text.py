"""Text in the engine: text and chat prompts, streamed text, stop strings,
end of sequence (against mlx-lm's own greedy decode and the tokenizer's decode)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockmgr.errors import InvalidArgument, WrongArgumentType
from scheduler import Engine, SamplingParams
from scheduler.core.request import RequestStatus
from scheduler.engine.text import SampleText
from tests.reference import greedy_reference

PROMPTS = ["Hello world", "The quick brown fox", "Paged attention keeps", "A prefix trie"]


def engine_of(tiny, **kw):
    model, tok = tiny
    kw.setdefault("num_blocks", 64)
    return Engine(model, block_size=8, tokenizer=tok, **kw)


def test_text_prompts_match_mlx_lm_greedy(tiny):
    model, tok = tiny
    engine = engine_of(tiny)
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs):
        ids = tok.encode(prompt)
        assert out.prompt_tokens == ids
        assert out.tokens == greedy_reference(model, ids, 12)
        assert out.text == tok.decode(out.tokens)
    engine.check_integrity()


def test_chat_messages_use_the_chat_template(tiny):
    model, tok = tiny
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    engine = engine_of(tiny)
    (out,) = engine.generate([chat], SamplingParams(max_tokens=6, ignore_eos=True))
    expected = tok.apply_chat_template(chat, add_generation_prompt=True)
    assert out.prompt_tokens == list(expected)
    assert out.prompt_tokens[-len(tok.encode("<|assistant|>")):] == tok.encode("<|assistant|>")
    assert out.tokens == greedy_reference(model, list(expected), 6)


def test_streamed_deltas_add_up_to_the_text(tiny):
    engine = engine_of(tiny)
    deltas: dict = {}
    tokens: dict = {}
    for r in engine.stream(PROMPTS, SamplingParams(max_tokens=15, ignore_eos=True)):
        deltas.setdefault(r.request_id, []).append(r.new_text[0] if r.new_text else "")
        tokens.setdefault(r.request_id, []).extend(r.new_tokens.get(0, []))
    _, tok = tiny
    for rid in deltas:
        assert "".join(deltas[rid]) == tok.decode(tokens[rid])
        assert len(deltas[rid]) > 2  # streamed, not one block at the end


def _reference_text(tiny, prompt, max_tokens=24):
    engine = engine_of(tiny)
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return out


def test_stop_string_cuts_the_text_and_frees_the_pages(tiny):
    _, tok = tiny
    for prompt in PROMPTS:
        ref = _reference_text(tiny, prompt)
        text = ref.text
        # a stop string from the middle of the reference text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        cut = text.find(stop)
        engine = engine_of(tiny, enable_prefix_cache=False)
        free = engine.cache.num_free_blocks
        deltas = []
        params = SamplingParams(max_tokens=24, ignore_eos=True, stop=["\x00never", stop])
        for r in engine.stream([prompt], params):
            deltas.append(r.new_text.get(0, ""))
            assert stop not in deltas[-1]
        assert "".join(deltas) == text[:cut]
        assert r.finished and r.finish_reasons == [RequestStatus.FINISHED_STOPPED]
        # generation ended at the first token after which the text shows the
        # stop string (an incomplete UTF-8 character at its end is held back)
        n = _first_showing(tok, ref.tokens, stop)
        request = engine.scheduler  # finished: no longer live, its pages are back
        assert request.get_request(r.request_id) is None
        assert engine.cache.block_manager.num_sequences == 0
        assert engine.cache.num_free_blocks == free
        assert engine.stats.num_generated_tokens == n
        engine.check_integrity()


def _first_showing(tok, tokens, stop):
    """The first k whose decoded text (an unfinished UTF-8 character at its
    end held back) shows the stop string."""
    for k in range(1, len(tokens) + 1):
        if stop in tok.decode(tokens[:k]).rstrip("\ufffd"):
            return k
    raise AssertionError("the stop string never shows")


def test_incremental_detokenizer_equals_decode(tiny):
    import numpy as np

    from scheduler.engine.text import IncrementalDetokenizer

    _, tok = tiny
    rng = np.random.default_rng(0)
    for trial in range(40):
        tokens = rng.integers(1, len(tok), size=rng.integers(1, 30)).tolist()
        if trial % 2:  # ordinary text, where words start with a space
            tokens = tok.encode(" hello world, the quick brown fox")[: len(tokens)]
        detok = IncrementalDetokenizer(tok, tok.encode("A prompt")[-5:])
        for token in tokens:
            detok.add_token(token)
            assert tok.decode(tokens).startswith(detok.text)  # released text never changes
        detok.finalize()
        assert detok.text == tok.decode(tokens)


def test_stop_string_with_n_samples(tiny):
    _, tok = tiny
    engine = engine_of(tiny)
    params = SamplingParams(max_tokens=30, n=3, temperature=1.0, ignore_eos=True,
                            stop=["ver"], seed=5)
    (out,) = engine.generate(["Hello world"], params)
    assert RequestStatus.FINISHED_STOPPED in out.finish_reasons  # seeded: deterministic
    for text, tokens, reason in zip(out.texts, out.outputs, out.finish_reasons):
        full = tok.decode(tokens)
        assert "ver" not in text
        if reason is RequestStatus.FINISHED_STOPPED:
            assert full.startswith(text + "ver")
        else:
            assert reason is RequestStatus.FINISHED_LENGTH and text == full
    assert engine.scheduler.num_running == 0
    engine.check_integrity()


def test_end_of_sequence_stops_and_adds_no_text(tiny):
    _, tok = tiny
    (eos,) = tok.eos_token_ids
    engine = engine_of(tiny)
    forced = SamplingParams(max_tokens=5, logit_bias={eos: 100.0})
    (out,) = engine.generate(["Hello"], forced)
    assert out.tokens == [eos] and out.text == ""
    assert out.finish_reasons == [RequestStatus.FINISHED_STOPPED]
    ignored = SamplingParams(max_tokens=5, logit_bias={eos: 100.0}, ignore_eos=True)
    (out,) = engine.generate(["Hello"], ignored)
    assert out.tokens == [eos] * 5
    assert out.finish_reasons == [RequestStatus.FINISHED_LENGTH]


def test_sample_text_holds_back_a_possible_stop_string():
    class Detok:  # one character per token
        def __init__(self):
            self.text = ""

        def add_token(self, token):
            self.text += chr(token)

        def finalize(self):
            pass

    sample = SampleText(Detok(), ("abc",), frozenset())
    got = [sample.add(ord(c)) for c in "xyabxab"]
    assert got == ["x", "y", "", "", "abx", "", ""]
    assert sample.finish() == "ab" and sample.text == "xyabxab"
    sample = SampleText(Detok(), ("abc", "yx"), frozenset())
    assert "".join(sample.add(ord(c)) for c in "zzabyxq") == "zzab" and sample.stopped
    assert sample.add(ord("q")) == "" and sample.finish() == ""


class ChunkDetok:
    """Token i's text is `chunks[i]` (any number of characters)."""

    def __init__(self, chunks):
        self.chunks = chunks
        self.text = ""

    def add_token(self, token):
        self.text += self.chunks[token]

    def finalize(self):
        pass


def brute_force_release(chunks: list[str], stop: list[str]) -> tuple[list[str], bool]:
    """The deltas a sample must release for text arriving in `chunks`, by
    the definition: the text stops at the first chunk whose text so far
    holds a stop string, cut at the earliest such string; until then every
    character is released except the longest end that begins a stop string
    (a proper prefix of one), and the rest at the end."""
    deltas, released, text = [], 0, ""
    for chunk in chunks:
        text += chunk
        found = [i for i in (text.find(s) for s in stop) if i >= 0]
        if found:
            cut = min(found)
            deltas.append(text[released:cut] if cut > released else "")
            return deltas, True
        held = max((k for k in range(1, len(text) + 1)
                    if any(s.startswith(text[-k:]) and len(s) > k for s in stop)), default=0)
        end = max(released, len(text) - held)
        deltas.append(text[released:end])
        released = end
    deltas.append(text[released:])
    return deltas, False


@given(stop=st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=6),
       chunks=st.lists(st.text("abcd", min_size=0, max_size=4), min_size=1, max_size=12))
@settings(max_examples=400, deadline=None)
def test_stop_strings_release_what_a_brute_force_search_releases(stop, chunks):
    """One automaton for every stop string (`StopStrings`) against a search
    of the whole text for each string after every chunk."""
    sample = SampleText(ChunkDetok(chunks), stop, frozenset())
    got = []
    for token in range(len(chunks)):
        got.append(sample.add(token))
        if sample.stopped:
            break
    if not sample.stopped:
        got.append(sample.finish())
    want, stopped = brute_force_release(chunks, stop)
    assert (got, sample.stopped) == (want, stopped)
    assert sample.text == "".join(want)


def test_the_stop_automaton_holds_back_and_cuts_at_the_longest_string():
    """Long stop strings sharing their prefixes: after a long text that
    only begins them, the held-back end is the longest one that begins a
    string; the character that completes one cuts at its start."""
    from scheduler.engine.text import StopStrings

    stops = [("ab" * 200)[:k] + "x" for k in range(100, 116)]  # 16 strings, 100-115 chars
    automaton = StopStrings(stops)
    text = "ab" * 5000
    state, cut = automaton.advance(0, text)
    assert cut is None and automaton.held_back(state) == 114  # "ab" * 57 begins k = 114, 115
    state, cut = automaton.advance(state, "x", len(text))
    assert cut == len(text) - 114  # "ab" * 57 + "x" (k = 114) ends here


def test_a_decode_fault_aborts_only_its_request(tiny):
    """The tokenizer's decode raises on one request's tokens: that request
    ends aborted with the error, in the step that met it; the others' texts
    are those of a run without it."""
    _, tok = tiny
    poison = 391

    class Faulty:
        def __init__(self, tokenizer):
            self._tokenizer = tokenizer

        def __getattr__(self, name):
            return getattr(self._tokenizer, name)

        def decode(self, tokens, *args, **kwargs):
            if poison in list(tokens):
                raise RuntimeError("injected decode fault")
            return self._tokenizer.decode(tokens, *args, **kwargs)

    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = engine_of(tiny).generate(PROMPTS, params)
    engine = Engine(tiny[0], num_blocks=64, block_size=8, tokenizer=Faulty(tok))
    victim = engine.get_request(
        engine.add_request(tok.encode("Numbers and symbols") + [poison], params))
    got = engine.generate(PROMPTS, params)
    assert [o.text for o in got] == [o.text for o in want]
    assert victim.status is RequestStatus.FINISHED_ABORTED
    assert "injected decode fault" in str(victim.error)
    assert victim.outputs[0] and len(victim.outputs[0]) < 10  # it ended at its first token
    engine.check_integrity()
    assert engine.cache.block_manager.num_sequences == 0


def test_text_needs_a_tokenizer_and_checks_its_input(tiny):
    model, tok = tiny
    plain = Engine(model, num_blocks=32, block_size=8)
    before = plain.debug_state()
    with pytest.raises(WrongArgumentType, match="tokenizer"):
        plain.add_request("Hello")
    with pytest.raises(InvalidArgument, match="stop strings"):
        plain.add_request([1, 2], SamplingParams(stop=["x"]))
    with pytest.raises(WrongArgumentType, match="TokenizerWrapper"):
        Engine(model, num_blocks=32, block_size=8, tokenizer="gpt2")
    assert plain.debug_state() == before
    engine = engine_of(tiny)
    before = engine.debug_state()
    bad = [
        ("", InvalidArgument, "empty"),
        ([{"content": "hi"}], InvalidArgument, "role"),
        ([{"role": "user", "content": 3}], WrongArgumentType, "content"),
        ([{"role": "user", "content": "x"}, "y"], WrongArgumentType, r"messages\[1\]"),
        ([{"role": "tool", "content": "x"}], InvalidArgument, "template refused"),
    ]
    for prompt, error, message in bad:
        with pytest.raises(error, match=message):
            engine.add_request(prompt)
    with pytest.raises(InvalidArgument, match="logit_bias"):
        engine.add_request("hi", SamplingParams(logit_bias={len(tok): 1.0}))
    assert engine.debug_state() == before


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"top_k": 0}, InvalidArgument, "top_k"),
        ({"top_k": 2.5}, WrongArgumentType, "top_k"),
        ({"min_p": 1.5}, InvalidArgument, "min_p"),
        ({"repetition_penalty": 0}, InvalidArgument, "repetition_penalty"),
        ({"presence_penalty": 3}, InvalidArgument, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, InvalidArgument, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, WrongArgumentType, "logit_bias"),
        ({"logit_bias": {1: 101}}, InvalidArgument, r"logit_bias\[1\]"),
        ({"logit_bias": [1]}, WrongArgumentType, "logit_bias"),
        ({"logprobs": 21}, InvalidArgument, "logprobs"),
        ({"logprobs": True}, WrongArgumentType, "logprobs"),
        ({"stop": [""]}, InvalidArgument, "stop"),
        ({"stop": [1]}, WrongArgumentType, "stop"),
        ({"stop": 5}, WrongArgumentType, "stop"),
        ({"ignore_eos": 1}, WrongArgumentType, "ignore_eos"),
        ({"logits_processors": [1]}, WrongArgumentType, r"logits_processors\[0\]"),
        ({"logits_processors": len}, WrongArgumentType, "logits_processors"),
    ],
)
def test_sampling_params_refuse_bad_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    p = SamplingParams(stop="ab", logit_bias={"7": 2}, top_k=3)
    assert p.stop == ("ab",) and p.logit_bias == {7: 2.0} and p.top_k == 3


def test_incremental_detokenizer_keeps_the_first_space_sentencepiece_style():
    """With a SentencePiece-style decoder, decoding an output alone drops its
    first space; started on the prompt's tail, the output text is what it
    adds to the prompt's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from scheduler.engine.text import IncrementalDetokenizer
    from tests.serve_model import SENTENCES

    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(SENTENCES * 4, trainers.BpeTrainer(vocab_size=300,
                                                                show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw)
    prompt = tok.encode("The quick brown")
    output = tok.encode("The quick brown fox jumps over")[len(prompt):]
    assert not tok.decode(output).startswith(" ")  # the space decoding alone loses
    detok = IncrementalDetokenizer(tok, prompt[-5:])
    for token in output:
        detok.add_token(token)
    detok.finalize()
    whole, head = tok.decode(prompt + output), tok.decode(prompt)
    assert detok.text == whole[len(head):] == " fox jumps over"
