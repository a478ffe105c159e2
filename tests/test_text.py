import itertools

from voicepipe.config import TTSConfig
from voicepipe.stages.agent import chunk_ends
from voicepipe.stages.tts import split_clauses
from voicepipe.text import count_tokens, first_clause_end, normalise, plain, speak, tokens_of


def test_speak_times_words_and_pauses():
    words = speak("Hi there [900] friend", 150)
    assert [w.text for w in words] == ["Hi", "there", "friend"]
    gap = words[2].start_ms - words[1].end_ms
    assert gap == 900
    assert all(b.start_ms >= a.end_ms for a, b in itertools.pairwise(words))
    assert speak("a [1.5s] b", 150)[1].start_ms - speak("a [1.5s] b", 150)[0].end_ms == 1500


def test_speaking_rate_scales_duration():
    slow = speak("one two three four", 100)[-1].end_ms
    fast = speak("one two three four", 200)[-1].end_ms
    assert abs(slow / fast - 2.0) < 1e-9


def test_plain_and_normalise():
    assert plain("I want, um, [700] a  table.") == "I want, um, a table."
    assert normalise("Yes, Friday!  OK?") == "yes friday ok"


def test_tokens_roughly_four_chars_and_keep_text():
    toks = tokens_of("Sure! One large oat-milk latte, anything else?")
    assert "".join(toks) == "Sure! One large oat-milk latte, anything else?"
    assert 9 <= len(toks) <= 14
    assert count_tokens("a b c") == 3


def test_first_clause_needs_min_words():
    words = ["Sure!", "One", "large", "latte,", "anything", "else?"]
    assert first_clause_end(words, 1) == 1
    assert first_clause_end(words, 3) == 4
    assert first_clause_end(words, 3, sentence=True) == 6
    assert first_clause_end(["no", "punctuation"], 1) is None


def test_tts_clause_aggregation_flushes_on_final():
    cfg = TTSConfig(min_clause_words=3)
    clauses, rest = split_clauses(["Sure,", "one", "large", "latte.", "And", "a"], cfg, final=False)
    assert clauses == [["Sure,", "one", "large", "latte."]]
    assert rest == ["And", "a"]
    clauses, rest = split_clauses(rest, cfg, final=True)
    assert clauses == [["And", "a"]] and rest == []


def test_agent_chunks_end_at_clauses_or_size():
    toks = tokens_of("Sure, one large latte with extra foam and cinnamon on top please.")
    ends = chunk_ends(toks, 4)
    assert ends[-1] == len(toks) - 1
    assert ends[0] == 0  # "Sure," ends a clause
    for a, b in itertools.pairwise(ends):
        assert toks[b + 1].startswith(" ") if b + 1 < len(toks) else True  # never splits a word
        assert b - a <= 4 + 3  # size limit, stretched to the end of the word
