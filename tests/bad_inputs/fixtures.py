"""Shared inputs the cases start from, each built once per session on first use (cases copy a fixture
before they change it)."""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path
from typing import Any

GOOD_LINE = {"qid": "p1", "problem": "What is 2+3?", "answer": "5"}


class Fixtures:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._server: Any = None

    @functools.cached_property
    def hf_dense(self) -> Path:
        """A random tiny Qwen3 (HF format, sharded safetensors, tokenizer), as ``mars init-model`` writes."""
        from mars_megatron.models.presets import init_model

        return Path(init_model("tiny-dense", self.root / "hf_dense"))

    @functools.cached_property
    def hf_moe(self) -> Path:
        from mars_megatron.models.presets import init_model

        return Path(init_model("tiny-moe", self.root / "hf_moe"))

    @functools.cached_property
    def mcore(self) -> Path:
        """``hf_dense`` converted to a mars Megatron checkpoint (one spawned gloo process)."""
        from mars_megatron import jobs
        from mars_megatron.config import ParallelConfig

        out = self.root / "mcore"
        layout = ParallelConfig()
        jobs.run(jobs.hf_to_mcore_job, layout, str(self.hf_dense), str(out), layout, None, "local", nproc=1)
        return out

    @functools.cached_property
    def train_ckpt(self) -> Path:
        """A ``mars train`` checkpoint root: ``step_000001`` whose shared policy is ``mcore``."""
        from mars_megatron.checkpoint.store import STATE_FORMAT

        root = self.root / "train_ckpt"
        step = root / "step_000001"
        step.mkdir(parents=True)
        shutil.copytree(self.mcore, step / "shared")
        state = {"format": STATE_FORMAT, "step": 1, "state": {"step": 1, "policies": ["shared"]}}
        (step / "trainer_state.json").write_text(json.dumps(state))
        (root / "latest").write_text("step_000001\n")
        return root

    @functools.cached_property
    def eval_data(self) -> Path:
        path = self.root / "eval.jsonl"
        path.write_text(json.dumps(GOOD_LINE) + "\n")
        return path

    @functools.cached_property
    def engine(self) -> Any:
        from mars_megatron.rollout.hf_engine import HFEngine

        return HFEngine(str(self.hf_dense))

    @functools.cached_property
    def tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.hf_dense)

    @property
    def server(self) -> Any:
        """An OpenAI-compatible server on 127.0.0.1 in front of ``engine`` (loopback: run in a namespace)."""
        if self._server is None:
            from mars_megatron.rollout.openai_server import OpenAICompletionsServer

            self._server = OpenAICompletionsServer(
                self.engine, model_name="tiny", tokenizer=self.tokenizer, max_tokens_limit=64,
                read_timeout_s=2.0,
            ).start()  # fmt: skip
        return self._server

    @functools.cached_property
    def app(self) -> Any:
        """The same server's request handling, without a socket (``complete(body)``)."""
        from mars_megatron.rollout.openai_server import OpenAICompletionsServer

        return OpenAICompletionsServer(
            self.engine, model_name="tiny", tokenizer=self.tokenizer, max_tokens_limit=64
        )

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
