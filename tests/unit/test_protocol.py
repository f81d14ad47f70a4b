import pytest

from forkd.guest import protocol


def test_frames_round_trip() -> None:
    frame = protocol.request(3, protocol.OP_EXEC, {"argv": ["echo", "ü"]})
    line = protocol.encode_frame(frame)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert protocol.decode_frame(line) == frame
    assert protocol.parse_request(frame) == (3, "exec", {"argv": ["echo", "ü"]})


@pytest.mark.parametrize("line", [b"not json\n", b"[1, 2]\n", b'"text"\n', b"\xff\xfe\n", b'{"id": 1} {"id": 2}\n',
                                  b'{"id": 1} x\n', b'\x0b{"id": 1}\n', b""])
def test_malformed_lines_raise_protocol_error(line: bytes) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.decode_frame(line)


def test_json_whitespace_around_a_frame_is_accepted() -> None:
    assert protocol.decode_frame(b' \t{"id": 1}\r\n') == {"id": 1}
    assert protocol.decode_frame('{"id": "ü"}'.encode()) == {"id": "ü"}


@pytest.mark.parametrize("frame", [{"op": "ping"}, {"id": "1", "op": "ping"}, {"id": True, "op": "ping"},
                                   {"id": 1}, {"id": 1, "op": "ping", "args": []}])
def test_bad_envelopes_are_refused(frame: dict) -> None:
    with pytest.raises(protocol.ProtocolError):
        protocol.parse_request(frame)


def test_oversized_frames_are_refused() -> None:
    with pytest.raises(protocol.ProtocolError, match="exceeds"):
        protocol.encode_frame({"id": 1, "data": "x" * protocol.MAX_FRAME_BYTES})


def test_terminal_frames_and_base64() -> None:
    assert protocol.is_terminal(protocol.ok(1, {}))
    assert protocol.is_terminal(protocol.error(1, protocol.ERR_TIMEOUT, "slow"))
    assert not protocol.is_terminal(protocol.event(1, protocol.EVENT_STDOUT, {"data_b64": ""}))
    assert protocol.b64decode(protocol.b64encode(b"\x00\xff")) == b"\x00\xff"
    with pytest.raises(protocol.ProtocolError):
        protocol.b64decode("not base64!")


def test_a_trace_is_asked_for_only_with_true() -> None:
    assert protocol.traced(protocol.request(1, "ping", trace=True))
    assert protocol.TRACE not in protocol.request(1, "ping")
    assert not protocol.traced({**protocol.request(1, "ping"), "trace": 1})


@pytest.mark.parametrize("marks", [
    "read", [["read"]], [["read", 1.5]], [["read", True]], [[1, 2]], [["x" * 33, 1]], [("read", 1)],
    [["read", n] for n in range(protocol.MAX_TRACE_MARKS + 1)],
])
def test_a_trace_of_the_wrong_shape_is_dropped_whole(marks: object) -> None:
    assert protocol.trace_marks({"trace": marks}) is None


def test_a_trace_gives_its_marks() -> None:
    assert protocol.trace_marks({"trace": [["read", 5], ["handled", 9]]}) == [("read", 5), ("handled", 9)]
    assert protocol.trace_marks({}) is None
