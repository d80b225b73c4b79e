"""What a request's prefix fingerprints cost, per KiB of body, beside what the gateway already does
with every body before it reaches an engine (parse, check, write the engine's copy).

Chat bodies of a system prompt and a growing history, from 1 KiB to 1 MiB; each step timed over
enough repeats to take about half a second, the best of three runs reported. In-process, one
core: ``.venv/bin/python -m bench.perf.prefix_cost``.
"""

from __future__ import annotations

import functools
import random
import time
from collections.abc import Callable
from typing import Any

import orjson

from capyctl_gateway._config import Api, GatewayConfig
from capyctl_gateway._http.validate import check_chat, engine_payload, resolve
from capyctl_gateway._routing.prefix import fingerprints

WORDS = [
    "the",
    "of",
    "billing",
    "refund",
    "parcel",
    "courier",
    "invoice",
    "desk",
    "answer",
    "kindly",
    "exact",
]
CONFIG = GatewayConfig.model_validate(
    {
        "deployments": [
            {
                "name": "m",
                "engine": "vllm",
                "engine_version": "0.31.0",
                "instances": [{"url": "http://127.0.0.1:9"}, {"url": "http://127.0.0.1:10"}],
            }
        ]
    }
)


def body_of(kib: int, rng: random.Random) -> bytes:
    system = " ".join(rng.choice(WORDS) for _ in range(kib * 90))
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for turn in range(6):
        msgs.append({"role": "user", "content": f"question {turn} " + rng.choice(WORDS)})
        msgs.append({"role": "assistant", "content": "answer " * 20})
    return orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 16})


def best_us(step: Callable[[], object]) -> float:
    n = 1
    while True:
        t = time.perf_counter()
        for _ in range(n):
            step()
        if time.perf_counter() - t > 0.05:
            break
        n *= 2
    reps = max(1, int(n * 0.5 / max(time.perf_counter() - t, 1e-9)))
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            step()
        runs.append((time.perf_counter() - t) / reps)
    return min(runs) * 1e6


def relay_work(raw: bytes) -> bytes:
    body, dep = resolve(raw, CONFIG, Api.CHAT, "/v1/chat/completions")
    check_chat(body, dep)
    return engine_payload(body, dep, chat=True, stream=False)


def main() -> None:
    rng = random.Random(1)
    print("| body | checks + engine copy | fingerprints | fingerprints per KiB | share |")
    print("|---|---|---|---|---|")
    for kib in (1, 8, 64, 512, 1024):
        raw = body_of(kib, rng)
        parsed = orjson.loads(raw)
        relay = best_us(functools.partial(relay_work, raw))
        fp = best_us(functools.partial(fingerprints, parsed, chat=True, salt=None, seed=7))
        size = len(raw) / 1024
        print(
            f"| {size:,.0f} KiB | {relay:,.1f} us | {fp:,.1f} us | {fp / size:.2f} us | "
            f"{fp / relay:.0%} |"
        )


if __name__ == "__main__":
    main()
