from voicepipe.config import ASRConfig
from voicepipe.stages.asr import endpoint_wait_ms, looks_complete


def test_silence_endpointing_waits_the_threshold():
    assert endpoint_wait_ms(ASRConfig(silence_ms=300), "anything", None) == (300, 0)


def test_smart_endpointing_short_when_complete_long_when_not():
    cfg = ASRConfig(
        endpointing="smart", smart_complete_ms=100, smart_incomplete_ms=2000, smart_inference_ms=12
    )
    assert endpoint_wait_ms(cfg, "I'd like a", True) == (100, 12)  # annotation wins
    assert endpoint_wait_ms(cfg, "I'd like a latte.", False) == (2000, 12)
    heur = cfg.model_copy(update={"smart_source": "heuristic"})
    assert endpoint_wait_ms(heur, "I'd like a", None) == (2000, 12)
    assert endpoint_wait_ms(heur, "I'd like a latte.", None) == (100, 12)


def test_completeness_heuristic():
    assert looks_complete("What time do you close?")
    assert looks_complete("a table for four people")
    assert not looks_complete("I'd like to book, um,")
    assert not looks_complete("Friday, or maybe")
    assert not looks_complete("")
    assert not looks_complete("The name is, er")
    assert not looks_complete("Yes, Friday,")
