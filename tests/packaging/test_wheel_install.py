"""The install path a user takes: build the wheel, install it without extras into
a fresh venv (torch pinned as constraints.txt says), serve the embedded default model with the
installed `octavo` command and complete a request through it; the only top-level import the
wheel adds is `octavo`, it holds the product and none of the benchmark scripts but the
load-test client, and `octavo bench serve` prints its flags and names the extra it needs."""

import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import free_port

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
INSTALL_TIMEOUT_S = 900
STARTUP_TIMEOUT_S = 120


def run(*command: str | Path, cwd: Path = ROOT, timeout: float = INSTALL_TIMEOUT_S) -> str:
    result = subprocess.run(
        [str(c) for c in command], capture_output=True, text=True, timeout=timeout, cwd=cwd
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The octavo wheel, built from this checkout."""
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", ".", "-w", dist)
    (built,) = dist.glob("octavo-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding torch (pinned) and the octavo wheel without extras."""
    venv = tmp_path_factory.mktemp("packaging") / "venv"
    run(sys.executable, "-m", "venv", venv)
    # --no-compile: pip byte-compiles every installed module (torch's thousands); what these
    # tests check needs only the modules they import, which compile on first use.
    pip = [
        venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--no-compile",
        "-c", "constraints.txt",
    ]  # fmt: skip
    run(*pip, "torch==2.13.0")
    run(*pip, wheel)
    return venv


def test_the_wheel_holds_the_product_and_of_the_benchmarks_only_the_load_test_client(wheel):
    with zipfile.ZipFile(wheel) as archive:
        contents = {name: archive.read(name) for name in archive.namelist()}
    # A build/ folder left by a build of an older tree adds its files too: `make clean`.
    package = {n.split("/")[1] for n in contents if n.startswith("octavo/") and n.count("/") > 1}
    assert package == {"engine", "kernels", "server", "bench"}, package
    bench = {n for n in contents if n.startswith("octavo/bench/")}
    assert bench == {f"octavo/bench/{m}.py" for m in ("__init__", "host", "load_test")}, bench
    # By content, wherever in the package a copy would land.
    shipped = set(contents.values())
    scripts = [p for p in (ROOT / "benchmarks").rglob("*.py") if p.name != "__init__.py"]
    assert scripts, "no benchmark scripts found"
    copied = sorted(str(p.relative_to(ROOT)) for p in scripts if p.read_bytes() in shipped)
    assert not copied, f"benchmark scripts in the wheel: {copied}"


def test_the_wheel_adds_only_the_octavo_package(venv, tmp_path):
    # Run from an empty folder: from the checkout, `python -c` would find its sources.
    python = venv / "bin" / "python"
    files = run(
        python, "-c",
        "import importlib.metadata as m; print('\\n'.join(str(f) for f in m.files('octavo')))",
        cwd=tmp_path,
    ).split()  # fmt: skip
    top_level = {f.split("/")[0] for f in files if not f.startswith("..")}
    assert top_level == {"octavo", "octavo-0.1.0.dist-info"}, top_level
    imported = run(
        python, "-c", "import octavo; from octavo import LLM, SamplingParams, BeamSearchParams; "
        "print(octavo.__file__)", cwd=tmp_path,
    )  # fmt: skip
    assert str(venv) in imported, imported
    assert "serve" in run(python, "-m", "octavo", "--help", cwd=tmp_path)
    installed = run(venv / "bin" / "python", "-m", "pip", "list", "--format=freeze")
    assert "nvidia" not in installed.lower(), "torch was not the pinned CPU build"


def test_the_installed_command_serves_the_default_model(venv, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen(
            [venv / "bin" / "octavo", "serve", "--port", str(port), "--log-level", "warning"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,  # not the checkout: nothing may come from the source tree
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with httpx.Client(timeout=1) as poller:  # one client: each new one costs CPU
            while True:
                assert server.poll() is None, log.read_text()
                try:
                    if poller.get(f"{base}/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        body = {"model": "octavo-tiny-chat", "prompt": "The while statement", "max_tokens": 8}
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] and choice["finish_reason"] in ("stop", "length")
        # The wheel carries the CPU decode kernel's source and ninja: it builds here.
        assert "could not be built" not in log.read_text()
    finally:
        server.terminate()
        assert server.wait(timeout=60) == 0, log.read_text()


def test_bench_serve_prints_its_flags_and_names_the_extra_it_needs(venv, tmp_path):
    flags = run(venv / "bin" / "octavo", "bench", "serve", "--help", cwd=tmp_path)
    assert "--request-rate" in flags and "--goodput" in flags, flags
    result = subprocess.run(
        [venv / "bin" / "octavo", "bench", "serve", "--num-prompts", "1"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert "pip install 'octavo[bench]'" in result.stderr
