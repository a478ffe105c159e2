"""One MQTT connection per process (voicepipe.bus.mqtt.link.MqttLink) and the lean reader of PUBLISH and PUBACK packets
(voicepipe.bus.mqtt.lean.LeanClient._take): shared deliveries, packets split across reads, MQTT 5 properties, paho's packets."""

from __future__ import annotations

import asyncio

import pytest

from voicepipe.bus.mqtt import BrokerAddress, LeanClient, MqttBus, MqttLink
from voicepipe.bus.mqtt.lean import _BufferedSocket
from voicepipe.messages import Envelope, UserUtterance, UserWord


def _word(i: int, run: str = "r5") -> Envelope:
    w = UserUtterance(words=[UserWord(text=f"w{i}", dur_ns=1, index=i, pause_before=False, last_word=False)])
    return Envelope.of(w, run, "s1", 0)


@pytest.mark.broker
async def test_stages_of_a_process_share_one_connection_and_each_parses_its_own_copy(mosquitto):
    addr = BrokerAddress.parse(mosquitto.url)
    link = MqttLink(addr, "r5", "p1")
    a, b = MqttBus(addr, "r5", "asr", link=link), MqttBus(addr, "r5", "tts", link=link)
    async with MqttBus(addr, "r5", "client") as pub, a, b:
        assert a.client is b.client and pub.client is not a.client
        await a.subscribe("user/utterance", "session/end")
        await b.subscribe("user/utterance")
        assert list(link.wire) == ["voicepipe/r5/+/user/utterance", "voicepipe/r5/+/session/end"]
        for i in range(50):
            await pub.publish(_word(i))

        async def take(bus: MqttBus) -> list[Envelope]:
            got: list[Envelope] = []
            async for _ch, e in bus.messages():
                got.append(e)
                if len(got) == 50:
                    return got
            return got

        async with asyncio.timeout(10):
            got_a, got_b = await asyncio.gather(take(a), take(b))
    assert (
        [e.payload.words[0].index for e in got_a]
        == [e.payload.words[0].index for e in got_b]
        == list(range(50))
    )
    assert all(x is not y for x, y in zip(got_a, got_b, strict=True))  # stages never share a message object
    assert link.delivered == 50  # one copy over the wire for the two stages
    assert a.received == b.received == 50
    assert link.users == 0 and link.client.lost  # the last bus out closed the connection


@pytest.mark.broker
async def test_lean_reader_takes_large_and_small_messages_intact_and_in_order(mosquitto):
    addr = BrokerAddress.parse(mosquitto.url)
    sizes = [10, 70_000, 3, 200_000, 1, 65_536, 65_535, 5] * 3  # bodies across the 64 KiB reads
    lean = addr.client(identifier="lean-big", factory=LeanClient, persistent=True, protocol="5")
    assert isinstance(lean, LeanClient)
    async with lean, addr.client(identifier="raw-pub") as raw:
        await lean.subscribe("big/#", qos=1)
        for k, n in enumerate(sizes):
            await raw.publish(f"big/{k}", bytes([k % 251]) * n, qos=1)
        got: list[tuple[str, bytes]] = []
        async with asyncio.timeout(10):
            while len(got) < len(sizes):
                await lean.wait()
                while lean.inbox:
                    got.append(lean.inbox.popleft())
    assert [t for t, _ in got] == [f"big/{k}" for k in range(len(sizes))]
    assert [bytes(b) for _, b in got] == [bytes([k % 251]) * n for k, n in enumerate(sizes)]


class _Chunks:
    """A non-blocking socket that hands out the given bytes a few at a time."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.step = data, step

    def recv(self, n: int) -> bytes:
        if not self.data:
            raise BlockingIOError
        out, self.data = self.data[: min(n, self.step)], self.data[min(n, self.step) :]
        return out


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 127, n >> 7
        out.append(b | (128 if n else 0))
        if not n:
            return bytes(out)


def _publish(t: str, body: bytes, qos: int, mid: int, props: bytes | None) -> bytes:
    head = len(t).to_bytes(2, "big") + t.encode() + (mid.to_bytes(2, "big") if qos else b"")
    if props is not None:
        head += _varint(len(props)) + props
    rest = head + body
    return bytes([0x30 | qos << 1]) + _varint(len(rest)) + rest


@pytest.mark.parametrize("protocol", ["3.1.1", "5"])
@pytest.mark.parametrize("step", [1, 3, 4096, 65536])
async def test_lean_reader_reassembles_packets_split_anywhere(protocol, step):
    addr = BrokerAddress.parse("mqtt://127.0.0.1:1")
    client = addr.client("unit", factory=LeanClient, persistent=True, protocol=protocol)  # never connected
    assert isinstance(client, LeanClient)
    v5 = protocol == "5"
    props = (b"\x01\x01" + b"\x23\x00\x07") if v5 else None  # payload format, a topic alias number
    big = b"x" * 70_000
    stream = (
        _publish("voicepipe/r/s1/user/utterance", b"hello", 1, 0x1234, props)
        # PUBACK for a mid nobody waits on (MQTT 5: reason "no matching subscribers"; 3.1.1: just the id)
        + (bytes([0x40, 3, 0x00, 0x07, 16]) if v5 else bytes([0x40, 2, 0x00, 0x07]))
        + _publish("voicepipe/r/s2/tts/audio", big, 0, 0, props and b"")
        + bytes([0xD0, 0x00])  # PINGRESP: paho's
        + _publish("voicepipe/r/s3/route", b"!", 1, 0x00FF, props)
    )
    got: list[tuple[str, bytes]] = []
    client.sink = lambda t, b: got.append((t, bytes(b)))
    w = _BufferedSocket(_Chunks(stream, step))
    seen: list[bool | None] = []
    while True:
        r = client._take(w)
        if r is None:
            if w.fill() <= 0:
                break
            continue
        seen.append(r)
        if r is False:  # paho's packet: skip it here as paho would consume it
            assert w.rbuf[w.rpos] == 0xD0
            w.rpos += 2
    assert seen == [True, True, True, False, True]
    assert got == [
        ("voicepipe/r/s1/user/utterance", b"hello"),
        ("voicepipe/r/s2/tts/audio", big),
        ("voicepipe/r/s3/route", b"!"),
    ]
    assert w.wbuf == [bytes([0x40, 2, 0x12, 0x34]), bytes([0x40, 2, 0x00, 0xFF])]  # a PUBACK per QoS 1


async def test_lean_reader_leaves_unusual_packets_to_paho():
    client = BrokerAddress.parse("mqtt://127.0.0.1:1").client("unit", factory=LeanClient, persistent=True)
    assert isinstance(client, LeanClient)
    for packet in (
        bytes([0x40, 3, 0x00, 0x07, 0x80]),  # PUBACK with an error code
        bytes([0x34, 5, 0, 1, ord("t"), 0, 1]),  # QoS 2 PUBLISH
        bytes([0x30, 2, 0, 0]),  # an empty topic (an alias)
        bytes([0x90, 3, 0, 1, 0]),  # SUBACK
        bytes([0x36, 5, 0, 1, ord("t"), 0, 1]),  # QoS 3: malformed
        bytes([0x40, 3, 0x00, 0x07, 0]),  # MQTT 3.1.1: a PUBACK longer than its packet id
        _publish("t", b"x" * (300 * 1024), 0, 0, None)[:64],  # a huge packet: paho's linear reader takes it
    ):
        w = _BufferedSocket(_Chunks(packet, 100))
        assert w.fill() == 1
        assert client._take(w) is False and w.rpos == 0  # untouched: paho reads and judges it


async def test_lean_reader_drops_a_topic_that_is_not_utf8_and_reads_on():
    """paho raises on such a topic at every read of the same packet (a wedged connection): the lean reader
    acknowledges it, counts it and goes on to the next packet."""
    client = BrokerAddress.parse("mqtt://127.0.0.1:1").client("unit", factory=LeanClient, persistent=True)
    assert isinstance(client, LeanClient)
    got: list[tuple[str, bytes]] = []
    client.sink = lambda t, b: got.append((t, bytes(b)))
    bad = b"\x00\x03\xff\xfe\xfd"  # topic length 3, invalid UTF-8
    packet = bytes([0x32, len(bad) + 2 + 1]) + bad + b"\x00\x09" + b"!"
    w = _BufferedSocket(_Chunks(packet + _publish("voicepipe/r/s/route", b"ok", 0, 0, None), 100))
    assert w.fill() == 1
    assert client._take(w) is True and client._take(w) is True
    assert got == [("voicepipe/r/s/route", b"ok")] and client.bad_topics == 1
    assert w.wbuf == [bytes([0x40, 2, 0x00, 0x09])]  # the bad one is still acknowledged (no redelivery loop)


async def test_a_filter_is_subscribed_once_and_no_stage_goes_on_before_its_suback():
    """Two stages of one process subscribe the same channel at once: one SUBSCRIBE goes out, and the second
    stage's subscribe returns only after the broker acknowledged it (it may set `ready` right after)."""
    from voicepipe.bus.mqtt import MqttLink

    link = MqttLink(BrokerAddress.parse("mqtt://127.0.0.1:1"), "r", "unit")
    suback = asyncio.Event()
    sent: list[str] = []

    class Slow:
        async def subscribe(self, t: str, qos: int) -> None:
            sent.append(t)
            await suback.wait()

    link.client = Slow()  # type: ignore[assignment]
    first = asyncio.create_task(link._want("user/utterance", 1))
    second = asyncio.create_task(link._want("user/utterance", 1))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not first.done() and not second.done() and len(sent) == 1
    suback.set()
    await asyncio.gather(first, second)
    assert len(sent) == 1 and link.wire == {"voicepipe/r/+/user/utterance": 1}
