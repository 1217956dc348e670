"""A model-free stand-in for EngineCore (one token per step per request, in milliseconds) with a real
word-level tokenizer, so the async front-end and the HTTP app run end to end without a model."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from pagedserve.config import ModelConfig, SchedulerConfig, StructuredOutputsConfig
from pagedserve.core.scheduler_output import SchedulerStats
from pagedserve.messages import EngineCoreOutput, EngineCoreRequest
from pagedserve.metrics.stats import EngineStats

PROMPT = "t1 t2"
TOO_LONG = " ".join(["t3"] * 20_001)  # more tokens than max_model_len
VOCAB = [f"t{i}" for i in range(100)] + ["[UNK]"]
UNK = 100


def word_tokenizer():
    # A real (fast) tokenizer, built offline: one word per token, "t0".."t99".
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


class FakeCore:
    """An EngineCore without a model: one token per step per request (token i at step i); records threads."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.model_name, self.max_model_len, self.num_kv_blocks = "fake", 20_000, 8
        self.kv_bytes_per_token = 46_080
        self.config = SimpleNamespace(cache=SimpleNamespace(block_size=16, cache_dtype="float32"), model=ModelConfig(),
                                      structured_outputs=StructuredOutputsConfig(), scheduler=SchedulerConfig(),
                                      speculative=None)
        self.loaded = SimpleNamespace(tokenizer=word_tokenizer(), hf_config=SimpleNamespace(vocab_size=len(VOCAB)),
                                      eos_token_ids=[], chat_template=None)
        self.stats = EngineStats()
        self.requests: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self.aborted: list[str] = []
        self.threads: set[int] = set()
        self.fail_next_step = False
        self.poisoned: set[str] = set()  # requests whose next step output is a per-request error
        self.stats_delay_s = 0.0  # how long a stats read (each snapshot) takes
        self.step_gate: threading.Event | None = None  # when set up, each step waits for it
        self.step_s = step_s
        self.batches: list[set[str]] = []  # the requests of each step
        self.entered = threading.Event()  # set when a step starts
        # urgent steps (engine/urgent_steps.py): set by the front-end; with take_mid_step each step takes the arrivals
        # once, as EngineCore does between two layers, and records the requests it then holds
        self.arrivals = None
        self.take_mid_step = False
        self.mid_step_requests: set[str] | None = None
        self.scheduler = SimpleNamespace(stats=self._sched_stats, requests=self.requests)

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def _sched_stats(self) -> SchedulerStats:
        self._touch()
        time.sleep(self.stats_delay_s)
        used = len(self.requests)
        return SchedulerStats(used, 0, used / self.num_kv_blocks, 0, 0, 0, self.num_kv_blocks - used,
                              self.num_kv_blocks)

    def add_requests(self, reqs) -> None:
        self._touch()
        if any(r.req_id in self.requests for r in reqs):
            raise ValueError("duplicate id")
        if any(UNK in r.prompt_token_ids for r in reqs):  # e.g. the prompt "crash"
            raise RuntimeError("a bug in the engine")
        for r in reqs:
            self.requests[r.req_id] = (r, [])

    def finish_requests(self, ids, status=None) -> None:
        self._touch()
        for rid in ids:
            if self.requests.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.requests)

    def step(self) -> list[EngineCoreOutput]:
        self._touch()
        self.entered.set()
        if self.step_gate is not None:
            self.step_gate.wait()
        if self.take_mid_step and self.arrivals is not None:
            self.arrivals.take()
            self.mid_step_requests = set(self.requests)
        self.batches.append(set(self.requests))
        time.sleep(self.step_s)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outs = []
        for rid, (req, tokens) in list(self.requests.items()):
            if rid in self.poisoned:
                del self.requests[rid]
                outs.append(EngineCoreOutput(rid, [], "error", error="RuntimeError: poisoned row"))
                continue
            tokens.append(len(tokens))
            done = len(tokens) >= req.max_tokens
            outs.append(EngineCoreOutput(rid, [tokens[-1]], "length" if done else None))
            if done:
                del self.requests[rid]
                self.stats.finished_by_reason["length"] += 1
        return outs
