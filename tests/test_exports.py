"""The public API is exactly what __all__ says, sorted, and every name resolves."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("module", ["canopyx_provider", "canopyx_provider.adapters"])
def test_all_is_sorted_and_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    names = list(mod.__all__)
    assert names == sorted(names)
    for name in names:
        assert getattr(mod, name) is not None, name


def test_public_names_are_exported_and_private_modules_stay_private() -> None:
    import canopyx_provider as pkg

    public = {n for n in vars(pkg) if not n.startswith("_")} | set(pkg._LAZY)
    public -= {"adapters", "cli", "annotations", "TYPE_CHECKING", "Any"}
    assert public == set(pkg.__all__)
    for name in pkg.__all__:
        obj = getattr(pkg, name)
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
            assert obj.__module__.startswith("canopyx_provider."), (name, obj.__module__)


def test_the_sdk_imports_without_aiohttp_until_asked() -> None:
    import subprocess
    import sys

    code = (
        "import sys, canopyx_provider as p; assert 'aiohttp' not in sys.modules; "
        "p.AiohttpFetcher; assert 'aiohttp' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_top_level_re_exports_every_adapter_factory_and_adapter_for() -> None:
    import canopyx_provider as pkg
    from canopyx_provider import adapters

    # origin() is for code that checks engine URLs itself (the gateway), not a factory.
    factories = {n for n in adapters.__all__ if n.islower()} - {"origin"}
    assert {"adapter_for", "vllm", "llama_cpp", "tabby_api"} <= factories
    for name in factories:
        assert getattr(pkg, name) is getattr(adapters, name), name
