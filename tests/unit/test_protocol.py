from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sclsd import protocol as P


def test_roundtrip_every_client_message() -> None:
    for msg in (P.Generate(prompt="hi", max_tokens=3, stop=["\n"]), P.Cancel(id="a"), P.Ping(nonce=4)):
        assert P.client_decoder.decode(P.encode(msg)) == msg


def test_roundtrip_worker_messages() -> None:
    res = P.Result(worker_id="w0", batch_id=3,
                   outputs=[P.RequestOutput(rid="r", token_ids=[1, 2], finish_reason="stop")],
                   stats=P.BatchStats(prefill_s=0.5, iterations=2))
    assert P.worker_decoder.decode(P.encode(res)) == res
    b = P.BatchMsg(batch_id=1, slice_len=4, requests=[P.BatchRequest(rid="r", token_ids=[5], max_new_tokens=2)])
    assert P.to_worker_decoder.decode(P.encode(b)) == b


@pytest.mark.parametrize(
    ("obj", "code"),
    [
        ({"type": "launch"}, "unknown_type"),
        ({"no_type": 1}, "unknown_type"),
        ({"type": "generate", "prompt": "x", "temperature": -1.0}, "bad_request"),
        ({"type": "generate", "prompt": "x", "top_p": 0.0}, "bad_request"),
        ({"type": "generate", "prompt": "x", "max_tokens": 0}, "bad_request"),
        ({"type": "generate", "prompt": 5}, "bad_request"),
        ({"type": "generate", "prompt_ids": [-1]}, "bad_request"),
        ({"type": "generate", "prompt": "x", "surprise": True}, "bad_request"),
        ({"type": "cancel"}, "bad_request"),
    ],
)
def test_bad_client_messages_are_classified(obj: object, code: str) -> None:
    with pytest.raises(P.DecodeError) as ei:
        P.client_decoder.decode(msgspec.msgpack.encode(obj))
    assert P.classify_decode_error(ei.value)[0] == code


def test_malformed_msgpack_is_bad_frame() -> None:
    with pytest.raises(P.DecodeError) as ei:
        P.client_decoder.decode(b"\xc1\xff\x00")
    assert P.classify_decode_error(ei.value)[0] == "bad_frame"


def test_frame_has_big_endian_length() -> None:
    f = P.frame(P.Ping())
    (n,) = P.FRAME_HEADER.unpack(f[:4])
    assert n == len(f) - 4 and f[:2] == b"\x00\x00"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=256))
def test_decoders_never_raise_anything_but_decode_errors(data: bytes) -> None:
    for dec in (P.client_decoder, P.status_decoder, P.worker_decoder, P.to_worker_decoder):
        try:
            dec.decode(data)
        except P.DecodeError:
            pass
