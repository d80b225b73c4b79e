"""``scripts/demo``'s deployment, run by the gateway against the real llama-server: the guide's
chat, streaming, Python and Responses examples, which send no ``max_tokens``, end by the model's
own end (the demo's tiny model ends its answers after a full stop; llama-server's own ``-n`` is
only a cap), so the openai client's ``responses.stream()`` ends ``completed``. And the demo
itself, as a process: its instructions as they are printed, and a next run after its own stop."""

from __future__ import annotations

import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import yaml
from openai import AsyncOpenAI

from contract.conftest import RunningGateway, serve_gateway
from contract.demo import PREDICT, demo_config, demo_model

pytestmark = pytest.mark.anyio
HELLO = {"model": "my-model", "messages": [{"role": "user", "content": "Hello"}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def demo_gateway(llama_server_binary: Path, tmp_path: Path) -> AsyncIterator[RunningGateway]:
    model = demo_model(tmp_path / "tiny.gguf")
    config = yaml.safe_load(demo_config(llama_server_binary, model))
    async for gw in serve_gateway(config, engine_logs=tmp_path / "logs"):
        yield gw


async def test_the_guides_requests_finish_on_the_demos_engine(demo_gateway: RunningGateway) -> None:
    auth = {"Authorization": f"Bearer {demo_gateway.key}"}
    # The first request starts llama-server; none of these would end without the cap.
    async with httpx.AsyncClient(base_url=demo_gateway.url, headers=auth, timeout=120) as c:
        whole = await c.post("/v1/chat/completions", json=HELLO)
        streamed = await c.post("/v1/chat/completions", json={**HELLO, "stream": True})
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["choices"][0]["finish_reason"] == "stop", body
    assert body["usage"]["completion_tokens"] < PREDICT
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    async with AsyncOpenAI(
        base_url=demo_gateway.url + "/v1", api_key=demo_gateway.key, max_retries=0, timeout=60
    ) as client:
        reply = await client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "Hello"}]
        )
        stream = await client.chat.completions.create(
            model="my-model", messages=[{"role": "user", "content": "Hello"}], stream=True
        )
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream])
    assert reply.choices[0].message.content and text
    assert reply.choices[0].logprobs is None and reply.choices[0].message.refusal is None


ROOT = Path(__file__).resolve().parents[2]


class Demo:
    """``scripts/demo``'s program as a process whose output is a pipe, not a terminal (as
    ``scripts/demo | tee demo.txt``): each line is handed over as it arrives."""

    def __init__(self, state: Path, *args: str) -> None:
        env = {**os.environ, "CAPYCTL_STATE_DIR": str(state), "CANOPYX_NO_MODIFY_PATH": "1"}
        self.stderr = (state.parent / f"demo-{time.monotonic_ns()}.err").open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "contract.demo", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=self.stderr,  # the gateway's log: not read here
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def until(self, start: str, *, timeout_s: float = 180) -> str:
        """The first line that starts with ``start`` (after its indent), as it comes."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                line = self.lines.get(timeout=max(left, 0.01))
            except queue.Empty:
                raise AssertionError(f"no line {start!r} in {timeout_s} s: {self.seen}") from None
            if line is None:
                raise AssertionError(f"the demo ended before {start!r}: {self.seen}")
            self.seen.append(line)
            if line.lstrip().startswith(start):
                return line

    def end(self, *, timeout_s: float = 60) -> int:
        rc = self.proc.wait(timeout_s)
        while (line := self.lines.get(timeout=timeout_s)) is not None:
            self.seen.append(line)
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self.stderr.close()
        return rc


@pytest.mark.timeout(420)
def test_the_demo_says_its_instructions_at_once_and_outlives_its_own_stop(
    llama_server_binary: Path, tmp_path: Path
) -> None:
    """Into a pipe the demo's instructions came only at Ctrl-C (issue 42, item 19); and after
    the ``capyctl stop my-model`` it prints, the next run died with ``KeyError: 'choices'``
    (item 18): the stop is kept in the state directory."""
    state = tmp_path / "state"
    demo = Demo(state)
    try:
        demo.until("Serving until Ctrl-C.")  # while it serves: every instruction is out
        assert any(line.startswith("curl -s ") for line in demo.seen), demo.seen
        stop = next(line for line in demo.seen if " stop my-model" in line)
        done = subprocess.run(shlex.split(stop), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "my-model: stopped" in done.stdout, done
    finally:
        demo.proc.send_signal(signal.SIGINT)
    assert demo.end() == 0 and demo.seen[-1] == "stopped.", demo.seen

    again = Demo(state, "--once")
    assert again.end(timeout_s=300) == 0, again.seen
    said = "\n".join(again.seen)
    assert "my-model was stopped by an operator" in said and "Its answer" in said, said


async def test_the_demos_responses_end_completed(demo_gateway: RunningGateway) -> None:
    """Every Response was ``incomplete`` (the 64-token cap), so ``responses.stream()`` raised
    at its end: the demo's model ends its answers by itself, well within the cap."""
    async with AsyncOpenAI(
        base_url=demo_gateway.url + "/v1", api_key=demo_gateway.key, max_retries=0, timeout=60
    ) as client:
        for _ in range(10):
            reply = await client.responses.create(model="my-model", input="Hello")
            assert reply.status == "completed" and reply.output_text, reply
            guide = await client.responses.create(
                model="my-model", input="Hello", max_output_tokens=64
            )
            assert guide.status == "completed", guide
            async with client.responses.stream(model="my-model", input="Hello") as stream:
                deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
                final = await stream.get_final_response()
            assert final.status == "completed" and final.output_text == "".join(deltas)
            assert final.usage is not None and final.usage.output_tokens < PREDICT
