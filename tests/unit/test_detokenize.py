import pytest

from chorus.engines.core.detokenize import TextAssembler
from chorus.engines.fake.engine import CharTokenizer

tok = CharTokenizer()


def run(text: str, stop: tuple[str, ...]) -> tuple[list[str], str, bool]:
    a = TextAssembler(tok.decode, stop)
    pieces = []
    for t in tok.encode(text):
        pieces.append(a.push(t))
        if a.stopped:
            break
    pieces.append(a.flush())
    return pieces, "".join(pieces), a.stopped


@pytest.mark.parametrize("text,stop,want,stopped", [
    ("hello world", (), "hello world", False),
    ("hello world", ("wor",), "hello ", True),
    ("hello world", ("xyz",), "hello world", False),
    ("hello world", ("o w", "ll"), "he", True),
    ("aaab", ("aab",), "a", True),
    ("end with sto", ("stop",), "end with sto", False),  # a partial stop at the end is released
])
def test_stop_strings(text: str, stop: tuple[str, ...], want: str, stopped: bool) -> None:
    _, out, did_stop = run(text, stop)
    assert out == want
    assert did_stop is stopped


def test_prefix_of_stop_is_held_back_until_ruled_out() -> None:
    pieces, out, _ = run("ab STOx", ("STOP",))
    assert out == "ab STOx"
    # "S", "T", "O" were not emitted while they could still start "STOP"
    assert pieces[3:6] == ["", "", ""]
    assert pieces[6] == "STOx"


def test_multibyte_characters_wait_until_complete() -> None:
    data = "é€".encode()

    def decode(ids):  # byte-level: one token per byte
        return bytes(ids).decode("utf-8", errors="replace")

    a = TextAssembler(decode)
    out = [a.push(b) for b in data]
    assert "".join(out) + a.flush() == "é€"
    assert all("\ufffd" not in p for p in out)
