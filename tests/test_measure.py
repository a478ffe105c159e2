from hypothesis import given
from hypothesis import strategies as st

from voicepipe.measure import BUS, measure
from voicepipe.messages import Span


def S(stage, what, start, dur, modelled=True):
    return Span(stage=stage, what=what, start_ns=start, dur_ns=dur, modelled=modelled)


def test_sequential_chain_with_gaps_goes_to_bus():
    spans = [S("transport", "uplink", 0, 100), S("asr", "wait", 103, 200), S("agent", "ttft", 310, 50)]
    m = measure(spans, 0, 365)
    parts = {(p.stage, p.what): p.ms * 1e6 for p in m.parts}
    assert parts[("transport", "uplink")] == 100
    assert parts[("asr", "wait")] == 200
    assert parts[("agent", "ttft")] == 50
    assert round(parts[BUS]) == 3 + 7 + 5
    assert m.predicted_ns == 350
    assert m.tax_ns == 15


def test_clips_spans_to_end_of_speech_and_first_audio():
    # preemptive work started before the user stopped; TTS still "running" after first audio
    spans = [S("agent", "ttft", -500, 700), S("tts", "ttfb", 200, 1000)]
    m = measure(spans, 0, 300)
    parts = {(p.stage, p.what): p.ms * 1e6 for p in m.parts}
    assert parts == {("agent", "ttft"): 200, ("tts", "ttfb"): 100}
    assert m.predicted_ns == 300


def test_overlap_goes_to_the_most_recent_cause():
    spans = [S("a", "x", 0, 100), S("b", "y", 50, 100)]
    m = measure(spans, 0, 150)
    parts = {(p.stage, p.what): p.ms * 1e6 for p in m.parts}
    assert parts == {("a", "x"): 50, ("b", "y"): 100}


def test_measured_spans_are_not_predicted():
    m = measure([S("bus", "hop", 0, 10, modelled=False), S("agent", "ttft", 10, 90)], 0, 100)
    assert m.predicted_ns == 90


spans_st = st.lists(
    st.builds(
        S,
        st.sampled_from(["asr", "agent", "tts"]),
        st.sampled_from(["a", "b"]),
        st.integers(-1000, 5000),
        st.integers(0, 3000),
        st.booleans(),
    ),
    max_size=12,
)


@given(spans_st, st.integers(0, 1000), st.integers(0, 6000))
def test_parts_always_sum_exactly_to_measured(spans, t0, length):
    m = measure(spans, t0, t0 + length)
    total_ns = sum(round(p.ms * 1e6) for p in m.parts)
    assert abs(total_ns - length) <= len(m.parts)  # float rounding of ns -> ms only
    assert 0 <= m.predicted_ns <= m.measured_ns
