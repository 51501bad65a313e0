"""The engine side of the engine tests: vLLM on a checkpoint, driven by one JSON request per line on stdin.

    .venv-vllm/bin/python tests/engine/engine_runner.py CHECKPOINT [--dtype float32|bfloat16]

It runs in .venv-vllm (made by .ci/setup_vllm) and imports only vLLM, torch, transformers (vLLM's), safetensors
and the standard library: the tests in .venv drive it through `engine_client.Engine`. One reply per request, one
line each, on stdout; vLLM's own output goes to stderr.

    {"op": "state"}                                  -> {"dtype": "torch.float32", "version": int | null, "names": [...]}
    {"op": "logprobs", "prompts": [[id, ...], ...]}  -> {"logprobs": [[log p(t[i+1] | t[:i+1]), ...], ...]}
    {"op": "load", "file": path, "names": [...], "version": v, "index": i, "is_last": b}
                                                     -> {"loaded": number of tensors}
    {"op": "restore"}                                -> {} (the checkpoint's weights, read from disk again)
    a request that fails                             -> {"error": "one sentence"}

`load` is one `load_weights` call of a weight sync: the tensors of `file` (safetensors), in the order of `names`,
go to the worker's `reload_weights` in place. The engine keeps what it was told: `version` is that of the last
sync whose last chunk it loaded, `names` the tensors of the last sync.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def register_loopcoder_config() -> None:
    """vLLM has LoopCoder's model (`iquest_loopcoder.py`) but no config class for its `model_type`; a plain config
    carries config.json's fields. Registered before the engine reads the checkpoint."""
    from transformers import AutoConfig, PretrainedConfig

    class IQuestLoopCoderConfig(PretrainedConfig):
        model_type = "iquestloopcoder"

    AutoConfig.register("iquestloopcoder", IQuestLoopCoderConfig)


class EngineRunner:
    def __init__(self, checkpoint: str, dtype: str):
        from vllm import LLM, SamplingParams

        self.llm = LLM(checkpoint, dtype=dtype, enforce_eager=True, skip_tokenizer_init=True,
                       distributed_executor_backend="uni")
        self.prompt_logprobs = SamplingParams(max_tokens=1, prompt_logprobs=0)
        self.version: int | None = None
        self.names: list[str] = []           # of the last sync, in arrival order
        self.pending: tuple[int, int] | None = None  # (version, next index) of a sync under way

    def state(self) -> dict:
        return {"dtype": str(self.llm.llm_engine.model_config.dtype), "version": self.version, "names": self.names}

    def logprobs(self, prompts: list[list[int]]) -> dict:
        if not prompts or any(len(prompt) < 2 for prompt in prompts):
            raise ValueError("logprobs needs prompts of at least two token ids (the first has no log-probability)")
        outputs = self.llm.generate([{"prompt_token_ids": prompt} for prompt in prompts], self.prompt_logprobs,
                                    use_tqdm=False)
        # position 0 is None; position i holds {token id: Logprob} for the prompt's own token i
        return {"logprobs": [[entry[token].logprob for token, entry in zip(prompt[1:], output.prompt_logprobs[1:])]
                             for prompt, output in zip(prompts, outputs)]}

    def load(self, file: str, names: list[str], version: int, index: int, is_last: bool) -> dict:
        from safetensors import safe_open

        expected = self.pending if index and self.pending else (version, 0)  # chunk 0 starts a sync (or a retry)
        if (version, index) != expected:
            raise ValueError(f"chunk {index} of sync {version} is out of sequence: expected chunk {expected[1]} "
                             f"of sync {expected[0]}")
        with safe_open(file, framework="pt") as tensors:
            if sorted(tensors.keys()) != sorted(names):
                raise ValueError(f"{file} holds {sorted(tensors.keys())}, the request names {sorted(names)}")
            weights = [(name, tensors.get_tensor(name)) for name in names]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        self.names = names if index == 0 else self.names + names
        self.pending = (version, index + 1)
        if is_last:
            self.llm.reset_prefix_cache()  # as an RL trainer's engine does after a sync: no KV of older weights
            self.version, self.pending = version, None
        return {"loaded": len(weights)}

    def restore(self) -> dict:
        self.llm.collective_rpc("reload_weights", kwargs={"is_checkpoint_format": True})  # from the checkpoint
        self.llm.reset_prefix_cache()
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    # replies travel on the original stdout; everything else printed in this process goes to stderr
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # the engine in this process (no engine-core process), its KV cache 1 GiB: enough for the tests' prompts
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    register_loopcoder_config()
    runner = EngineRunner(args.checkpoint, args.dtype)
    operations = {"state": runner.state, "logprobs": runner.logprobs, "load": runner.load, "restore": runner.restore}
    for line in sys.stdin:
        request = json.loads(line)
        operation = operations.get(request.pop("op", None))
        try:
            if operation is None:
                raise ValueError(f"unknown request {line.strip()[:200]}: the operations are {sorted(operations)}")
            reply = operation(**request)
        except (ValueError, TypeError, KeyError) as error:
            reply = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(reply), file=replies)


if __name__ == "__main__":
    main()
