"""The trainer side of the engine tests: a real vLLM engine (engine_runner.py, in .venv-vllm) in a subprocess.

The two venvs cannot share a process (vLLM 0.32 pins torch 2.13 and transformers < 5.20). Requests and replies are
JSON lines; a chunk's tensors travel as a safetensors file in the engine's work folder.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RUNNER = Path(__file__).with_name("engine_runner.py")
NO_ENGINE = f"{ENGINE_PYTHON} is missing: the engine tests need vLLM's venv, made by 'bash .ci/setup_vllm'"
START_SECONDS = 600    # importing vLLM and starting an engine: about 40 s alone on 2 cores, more when shared
REQUEST_SECONDS = 300
# glibc fills every block it hands out with the byte MALLOC_PERTURB ^ 0xFF (and freed blocks with MALLOC_PERTURB):
# the engine's uninitialised tensors read 0x41414141 (12.1 in fp32, 12.0 in bf16) in every run instead of whatever a
# freed buffer held, so reading them is caught the same way each time (the split-group control)
MALLOC_PERTURB = 0x41 ^ 0xFF


class EngineError(RuntimeError):
    """The engine refused a request, or its process ended or stopped answering."""


class Engine:
    """`Engine(checkpoint, "float32", workdir)`: vLLM serving `checkpoint`; `close()` ends its process."""

    def __init__(self, checkpoint: Path, dtype: str, workdir: Path):
        self.checkpoint, self.workdir = checkpoint, workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.log = workdir / "engine.log"
        with self.log.open("w") as log:
            self.process = subprocess.Popen([str(ENGINE_PYTHON), str(RUNNER), str(checkpoint), "--dtype", dtype],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                            cwd=workdir, env={**os.environ, "MALLOC_PERTURB_": str(MALLOC_PERTURB)})
        self.request({"op": "state"}, START_SECONDS)  # answered once the engine has started

    def request(self, message: dict, timeout: float = REQUEST_SECONDS) -> dict:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            reason = "stopped answering" if not ready else f"exited with code {self.process.wait()}"
            raise EngineError(f"the engine {reason} on {message['op']!r}; {self.log} ends with:\n{self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise EngineError(f"the engine refused {message['op']!r}: {reply['error']}")
        return reply

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def logprobs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The engine's prompt log-probs of rows [b, s]: [b, s - 1], as `provider.token_logprobs` gives them."""
        reply = self.request({"op": "logprobs", "prompts": input_ids.tolist()})
        return torch.tensor(reply["logprobs"], dtype=torch.float32)

    def load(self, tensors: list[tuple[str, torch.Tensor]], version: int, index: int, is_last: bool) -> None:
        """One `load_weights` call: `tensors` (full tensors, engine naming) go to the engine together."""
        file = self.workdir / "chunk.safetensors"
        save_file({name: tensor.contiguous() for name, tensor in tensors}, str(file))
        self.request({"op": "load", "file": str(file), "names": [name for name, _ in tensors], "version": version,
                      "index": index, "is_last": is_last})

    def push(self, chunks) -> None:
        """One weight sync: every `modelzoo.sync.WeightChunk` of it, one load each."""
        for chunk in chunks:
            self.load(chunk.tensors, chunk.version, chunk.index, chunk.is_last)

    def state(self) -> dict:
        return self.request({"op": "state"})

    def restore(self) -> None:
        """Back to the checkpoint's weights, read from disk by the engine's own loader."""
        self.request({"op": "restore"})

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
