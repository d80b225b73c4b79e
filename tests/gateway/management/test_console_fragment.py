"""The console's page given a link whose ``#key=`` is not a readable %-escape: it asks for the
key instead of stopping on the error (a blank page). Headless Chromium, as
``test_console_browser.py``, whose fixtures it uses."""

from __future__ import annotations

import pytest
from bench.browser import Browser

from tests.gateway.management.test_console import Console, console_of, launched_console  # noqa: F401
from tests.gateway.management.test_console_browser import browser  # noqa: F401

pytestmark = pytest.mark.anyio


async def test_a_malformed_key_in_the_link_asks_for_the_key(
    browser: Browser,  # noqa: F811
    launched_console: Console,  # noqa: F811
) -> None:
    await browser.goto(f"{launched_console.url}/#key=abc%E0%A4%A")
    message = await browser.until("document.querySelector('#keymsg')?.textContent")
    assert "could not be read" in message
    assert await browser.js("document.querySelector('#keyform').hidden") is False
    assert await browser.js("location.hash") == ""  # the broken key left the address bar
    assert await browser.js("sessionStorage.getItem('capyctl-key')") is None
