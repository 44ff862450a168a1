"""``transformers serve`` for a local checkpoint as a subprocess on the loopback interface: a free port, a bounded
wait for readiness, always stopped (a context manager). Used by the serving tests and benchmark; handy for trying
an SBD checkpoint (``sbd-ext export DIR``) with any OpenAI client.

    with TransformersServer("my-sbd-model", trust_remote_code=True) as server:
        client = server.client()      # an openai.OpenAI for it; requests name model=server.model

Nothing is fetched: the server runs with ``HF_HUB_OFFLINE=1`` and no update check.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["TransformersServer", "VLLMServer", "free_port"]

HOST = "127.0.0.1"
_LAUNCH = "from transformers.cli.transformers import main; main()"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class TransformersServer:
    """``transformers serve MODEL --host 127.0.0.1 --port <free>`` in a subprocess (see the module docstring).

    Args:
        model: the checkpoint folder, preloaded for every request (``force_model``).
        trust_remote_code: pass ``--trust-remote-code`` (needed for ``custom_generate/``, i.e. SBD).
        extra_args: more ``transformers serve`` options (e.g. ``["--continuous-batching"]``).
        threads: ``OMP_NUM_THREADS`` of the server (None: inherited).
        ready_timeout: seconds to wait for ``/health`` (then the server is stopped and RuntimeError raised).
    """

    name = "transformers serve"

    def __init__(
        self,
        model: str | os.PathLike,
        trust_remote_code: bool = False,
        extra_args: list[str] | tuple[str, ...] = (),
        threads: int | None = 1,
        ready_timeout: float = 180.0,
    ):
        # A local folder is passed as an absolute path (the server runs in another working folder).
        self.model = str(Path(model).resolve()) if Path(model).exists() else str(model)
        self.port = free_port()
        self.base_url = f"http://{HOST}:{self.port}/v1"
        args = [self.model, "--host", HOST, "--port", str(self.port), "--device", "cpu", *extra_args]
        if trust_remote_code:
            args.append("--trust-remote-code")
        self.command = [sys.executable, "-c", _LAUNCH, "serve", *args]
        self.threads = threads
        self.ready_timeout = ready_timeout
        self.env: dict[str, str] = {}  # more environment for the server process
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._cwd: str | None = None

    def client(self, timeout: float = 300.0):
        """An ``openai.OpenAI`` client of this server (no retries: a failed request is reported, not repeated)."""
        import openai  # the serving extra

        return openai.OpenAI(base_url=self.base_url, api_key="none", timeout=timeout, max_retries=0)

    @property
    def log_text(self) -> str:
        """Everything the server wrote so far (stdout and stderr)."""
        if self._log is None:
            return ""
        return Path(self._log.name).read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 10.0) -> bool:
        """Whether ``text`` appears in the server's output within ``timeout`` seconds (tracebacks are written
        after the response is sent)."""
        deadline = time.monotonic() + timeout
        while text not in self.log_text:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def start(self) -> TransformersServer:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_DISABLE_UPDATE_CHECK="1", PYTHONUNBUFFERED="1")
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.update(self.env)
        self._log = tempfile.NamedTemporaryFile("w+b", prefix="transformers-serve-", suffix=".log", delete=False)
        # An empty working folder: ``python -c`` puts the working folder on sys.path, and a source checkout there
        # (its un-built sbd_ext) would shadow the installed package in the server.
        self._cwd = tempfile.mkdtemp(prefix="transformers-serve-")
        # A session of its own: stop() reaches the processes the server starts (vLLM's engine core).
        self.proc = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=self._cwd, start_new_session=True
        )
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_text[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://{HOST}:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {self.ready_timeout:.0f} s:\n{self.log_text[-4000:]}")

    def stop(self) -> None:
        """Terminate the server and what it started (kill them after 10 s); idempotent."""
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)  # the session start() made: the server and its children
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue

    def close(self) -> None:
        """Stop the server and delete its log."""
        self.stop()
        if self._log is not None:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)
            self._log = None
        if self._cwd is not None:
            shutil.rmtree(self._cwd, ignore_errors=True)
            self._cwd = None

    def __enter__(self) -> TransformersServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class VLLMServer(TransformersServer):
    """``vllm serve MODEL --host 127.0.0.1 --port <free>`` (vLLM's OpenAI server, its CPU build) in a subprocess,
    fp32, eager; ``speculative_config``: e.g. ``{"method": "custom_class", "model":
    "sbd_ext.integration.vllm.SBDProposer", "num_speculative_tokens": 4}`` (:mod:`sbd_ext.integration.vllm`).
    ``threads``: the CPU threads of vLLM's engine (bound to cores ``0..threads-1``); ``env``: more environment
    (e.g. ``SBD_EXT_VLLM_STATS``); ``python``: the interpreter that runs it (default: this one), e.g.
    ``.venv-vllm/bin/python`` from another venv. Needs vLLM (and sbd_ext) installed there (``tools/vllm_env.sh``)."""

    name = "vllm serve"

    def __init__(
        self,
        model: str | os.PathLike,
        speculative_config: dict | None = None,
        extra_args: list[str] | tuple[str, ...] = (),
        threads: int = 1,
        ready_timeout: float = 600.0,
        max_model_len: int = 1024,
        max_num_seqs: int = 4,
        env: dict[str, str] | None = None,
        python: str | os.PathLike | None = None,
    ):
        super().__init__(model, threads=threads, ready_timeout=ready_timeout)
        args = ["--dtype", "float32", "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
        args += ["--enforce-eager", *extra_args]
        if speculative_config is not None:
            args += ["--speculative-config", json.dumps(speculative_config)]
        launch = "from sbd_ext.integration.vllm import vllm_cli; vllm_cli()"  # vLLM's CLI (see vllm_cli)
        exe = str(python) if python is not None else sys.executable  # e.g. vLLM's own venv (tools/vllm_env.sh)
        self.command = [exe, "-c", launch, "serve", self.model, "--host", HOST, "--port", str(self.port)]
        self.command += args
        self.env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1
                    else "0", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(env or {})}  # fmt: skip

    def complete(self, prompt_ids: list[int], max_tokens: int, **body) -> dict:
        """A greedy ``/v1/completions`` request with the prompt as token ids (``body``: more request fields, e.g.
        ``return_token_ids=True``); returns the response as JSON."""
        body = {"model": self.model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0, **body}
        req = urllib.request.Request(
            f"{self.base_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=900) as r:
            return json.loads(r.read())

    def spec_decode_counters(self) -> dict[str, float]:
        """vLLM's speculative-decoding counters from its ``/metrics`` (summed over labels): ``num_drafts``,
        ``num_draft_tokens``, ``num_accepted_tokens`` (mean tokens per cycle = 1 + accepted / drafts)."""
        with urllib.request.urlopen(f"http://{HOST}:{self.port}/metrics", timeout=30) as r:
            lines = r.read().decode().splitlines()
        out = {}
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            prefix = f"vllm:spec_decode_{name}_total"
            out[name] = sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))
        return out
