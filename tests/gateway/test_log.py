"""JSON log lines: one write per event-loop iteration, in order, the same shape either way."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator

import orjson
import pytest

from capyctl_gateway._log import (
    JsonFormatter,
    JsonLines,
    event,
    logger,
    masked,
    secrets_in,
    shown,
)


class Writes(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes.append(bytes(data))
        return super().write(data)


@pytest.fixture
def sink() -> Iterator[Writes]:
    """The root logger with only a JsonLines handler, as ``--log-format json`` leaves it."""
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    stream = Writes()
    root.handlers[:] = [JsonLines(stream)]
    root.setLevel(logging.INFO)
    try:
        yield stream
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


def lines(stream: Writes) -> list[dict[str, object]]:
    return [orjson.loads(x) for x in stream.getvalue().splitlines()]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_one_iteration_s_lines_leave_in_one_write_in_order(sink: Writes) -> None:
    event("router_selection", "unused in json", capyctl_request_id="01A", instance=0)
    logger.warning("engine stream unverified (%s): %s", "m", "why")
    event("router_failover", "unused", capyctl_request_id="01A", reason="not_accepted")
    assert sink.writes == []  # nothing yet: the iteration is not over
    await asyncio.sleep(0)  # let the loop finish this iteration
    assert len(sink.writes) == 1
    first, warning, third = lines(sink)
    assert {k: v for k, v in first.items() if k != "ts"} == {
        "level": "info",
        "event": "router_selection",
        "capyctl_request_id": "01A",
        "instance": 0,
    }
    assert warning["level"] == "warning"
    assert warning["message"] == "engine stream unverified (m): why"
    assert third["event"] == "router_failover"


def test_outside_a_loop_each_line_is_written_at_once(sink: Writes) -> None:
    event("router_selection", "unused", capyctl_request_id="01B")
    assert len(sink.writes) == 1 and lines(sink)[0]["capyctl_request_id"] == "01B"


def test_the_direct_line_matches_the_formatter_s(sink: Writes) -> None:
    event("router_selection", "msg", capyctl_request_id="01C", host="h")
    direct = lines(sink)[0]
    record = logger.makeRecord(
        logger.name,
        logging.INFO,
        "f",
        1,
        "msg",
        (),
        None,
        extra={"event": "router_selection", "fields": {"capyctl_request_id": "01C", "host": "h"}},
    )
    formatted = orjson.loads(JsonFormatter().format(record))
    assert list(direct) == list(formatted)  # same keys, same order
    assert {k: v for k, v in direct.items() if k != "ts"} == {
        k: v for k, v in formatted.items() if k != "ts"
    }


def test_lines_are_not_held_by_a_loop_that_stopped_before_flushing(sink: Writes) -> None:
    loop = asyncio.new_event_loop()
    try:

        async def log_and_stop() -> None:
            event("router_selection", "unused", capyctl_request_id="01D")
            loop.stop()  # the scheduled flush never runs on this loop

        loop.create_task(log_and_stop())
        loop.run_forever()
    finally:
        loop.close()
    assert sink.writes == []
    event("router_selection", "unused", capyctl_request_id="01E")  # no loop now: written at once
    assert [line["capyctl_request_id"] for line in lines(sink)] == ["01D", "01E"]


def test_a_handler_above_info_gets_no_events(sink: Writes) -> None:
    logging.getLogger().handlers[0].setLevel(logging.WARNING)
    event("router_selection", "unused", capyctl_request_id="01F")
    assert sink.writes == []


# -- masking ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("--api-key sk-live-1 --port 8", "--api-key *** --port 8"),
        ("HF_TOKEN=hf_abc rest", "HF_TOKEN=*** rest"),
        ('{"token": "t0k"}', '{"token": "***"}'),
        ("Authorization: Bearer abc.def", "Authorization: Bearer ***"),
        ("db_password: hunter2", "db_password: ***"),
        # A name that says tokens (plural) is still a secret's...
        ("--api-tokens sk-live-1 --port 8", "--api-tokens *** --port 8"),
        ("AUTH_TOKENS=abc123 rest", "AUTH_TOKENS=*** rest"),
        ('{"tokens": "t0k"}', '{"tokens": "***"}'),
        # ...and a key, secret or password stays masked even when it is all digits.
        ("--api-key 12345678", "--api-key ***"),
        ("db_password=123456", "db_password=***"),
        # Counts of tokens are not secrets: an engine's log is full of them.
        ("stop processing: n_tokens = 20, truncated = 0", None),
        ("prompt eval time = 0.24 ms / 1 tokens", None),
        ("--max-tokens 64 -n 64", None),
        ("max_num_batched_tokens=8192, max_tokens: 2.5", None),
        ("--max-tokens 64x", "--max-tokens ***"),
        # issue 34, item 15: llama-server's short -hft, a list in a repr, a URL's userinfo
        ("llama-server -hft hf_abc --port 8", "llama-server -hft *** --port 8"),
        ("{'api_key': ['sk-live-1'], 'port': 8}", "{'api_key': ['***'], 'port': 8}"),
        ('"api_key": ["sk-live-1"]', '"api_key": ["***"]'),
        # issue 42, item 12: a URL's whole userinfo (a token is often its user name), reprs of
        # tuples and lists (an argv, a header pair, a list's later items), Token headers
        ("from https://user:s3cret@example.org/x", "from https://***@example.org/x"),
        ("at https://example.org:8443/x and a@b", None),
        (
            "git clone https://ghp_abc123@github.com/o/r.git",
            "git clone https://***@github.com/o/r.git",
        ),
        ("fetch http://hf_abc@10.0.0.7:8000/m", "fetch http://***@10.0.0.7:8000/m"),
        ("('llama-server', '--api-key', 'sk-live-1')", "('llama-server', '--api-key', '***')"),
        ('["--hf-token", "hf_abc", "--port", "8"]', '["--hf-token", "***", "--port", "8"]'),
        ("('api_key', 'sk-live-1')", "('api_key', '***')"),
        ("['--echo-env', 'ENGINE_KEY', '--port', '8']", None),
        ("{'api_keys': ['sk-1', 'sk-2', 'sk-3']}", "{'api_keys': ['***', '***', '***']}"),
        ('"api_key": ["sk-1", "sk-2"]', '"api_key": ["***", "***"]'),
        ("Authorization: Token abc.def", "Authorization: Token ***"),
        ("authorization=Token abc.def rest", "authorization=Token *** rest"),
        ("[('Authorization', 'Token abc')]", "[('Authorization', 'Token ***')]"),
        ("Proxy-Authorization: s3cret", "Proxy-Authorization: ***"),
        # counts stay readable in those forms too
        ("('--max-tokens', '64')", None),
        ("{'max_tokens': [64, 128]}", None),
    ],
)
def test_masked_hides_secrets_and_leaves_token_counts(text: str, want: str | None) -> None:
    assert masked(text) == (text if want is None else want)


def test_shown_masks_a_flags_value_but_not_a_token_count() -> None:
    argv = ["llama-server", "--api-key", "s3cret", "--hf-token=x", "--max-tokens", "64"]
    assert shown(argv) == [
        "llama-server",
        "--api-key",
        "***",
        "--hf-token=***",
        "--max-tokens",
        "64",
    ]


def test_shown_masks_llama_servers_short_token_flag() -> None:
    argv = ["llama-server", "-hft", "hf_abc", "-hf", "org/model", "-hft=hf_def", "-n", "64"]
    assert shown(argv) == [
        "llama-server", "-hft", "***", "-hf", "org/model", "-hft=***", "-n", "64",
    ]  # fmt: skip


def test_shown_masks_plural_token_names_and_numeric_keys() -> None:
    argv = [
        "e",
        "--access-tokens",
        "abc",
        "--api-key",
        "1234",
        "--max-tokens=64",
        "--n-tokens",
        "8",
    ]
    assert [a for a, s in zip(argv, shown(argv), strict=True) if s != a] == ["abc", "1234"]


def test_secrets_in_takes_plural_token_variables_but_not_counts() -> None:
    env = {"HF_TOKENS": "v", "MAX_TOKENS": "64", "API_KEY": "1234", "PATH": "/bin"}
    assert sorted(secrets_in(["e", "--access-tokens", "abc", "--max-tokens", "64"], env)) == [
        "1234",
        "abc",
        "v",
    ]


def test_a_urls_userinfo_in_a_command_is_a_secret() -> None:
    """A token given as a URL's user name (or user and password) in an argument or a variable
    is found, so a pod's command that carries one is refused and a log masks it."""
    argv = ["hf", "download", "https://hf_abc@huggingface.co/m", "--url=http://u:p4ss@h:8/x"]
    env = {"MODEL_URL": "https://tok_9@example.org/m", "PATH": "/bin"}
    assert sorted(secrets_in(argv, env)) == ["hf_abc", "tok_9", "u:p4ss"]
    assert shown(argv) == [
        "hf",
        "download",
        "https://***@huggingface.co/m",
        "--url=http://***@h:8/x",
    ]
    assert secrets_in(["e", "https://example.org:8443/x", "a@b"], {"X": "http://h/x@y"}) == []
