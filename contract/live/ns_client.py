"""A client run inside a network namespace by the several-machines live tests (the test process
itself is outside every namespace): ``python -m contract.live.ns_client chat|post ...``.

It prints what it sees, one line at a time, flushed: ``HEAD <status>``, then ``DATA <line>``
for each line of a stream or ``BODY <text>`` for a whole answer, then ``END``. With
``--hang-up-after-content`` it closes the connection once the first content arrived and prints
``HUNG UP``. ``--prompt-bytes N`` sends a prompt of N bytes of plain text instead of the short one
(too long for a command line past 128 KiB, so it is made here).
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _has_content(line: str) -> bool:
    if not line.startswith("data: {"):
        return False
    choices = json.loads(line.removeprefix("data: ")).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["chat", "post"])
    p.add_argument("--url", required=True)
    p.add_argument("--key", default=None)
    p.add_argument("--model", default="tiny")
    p.add_argument("--stream", action="store_true")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--caller", default=None)
    p.add_argument("--hang-up-after-content", action="store_true")
    p.add_argument("--body", default=None, help="post: the JSON body")
    p.add_argument("--prompt-bytes", type=int, default=None, help="chat: a prompt this long")
    a = p.parse_args()
    headers = {}
    if a.key is not None:
        headers["Authorization"] = f"Bearer {a.key}"
    if a.caller is not None:
        headers["X-Request-Id"] = a.caller
    if a.what == "post":
        r = httpx.post(a.url, content=(a.body or "{}").encode(), headers=headers, timeout=30)
        _say(f"HEAD {r.status_code}")
        _say(f"BODY {r.text}")
        _say("END")
        return
    prompt = "Tell me a long story about the sea."
    if a.prompt_bytes is not None:
        prompt = ("the sea is wide and deep " * (a.prompt_bytes // 25 + 1))[: a.prompt_bytes]
    body = {
        "model": a.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": a.max_tokens,
        "stream": a.stream,
    }
    with httpx.Client(timeout=120) as client:
        url = a.url + "/v1/chat/completions"
        with client.stream("POST", url, json=body, headers=headers) as r:
            _say(f"HEAD {r.status_code}")
            if not a.stream:
                _say("BODY " + json.dumps(json.loads(r.read())))
                _say("END")
                return
            for line in r.iter_lines():
                if not line:
                    continue
                _say(f"DATA {line}")
                if a.hang_up_after_content and _has_content(line):
                    _say("HUNG UP")
                    return
    _say("END")


if __name__ == "__main__":
    main()
