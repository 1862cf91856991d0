"""The engine loop: schedule a step, run the model on the packed tokens, sample, finish requests."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from worker.engine.attention import KVCache, KVGroup, kv_groups, split_kv_blocks
from worker.engine.block_manager import BlockCoordinator, BlockManager, blocks_for
from worker.engine.config import DTYPES, EngineConfig
from worker.engine.identity import NumericsIdentity, numerics_identity
from worker.engine.kv_budget import cpu_kv_budget
from worker.engine.loader import calibration_dir, load_checkpoint
from worker.engine.model import DecoderModel
from worker.engine.outputs import EngineStats, RequestOutput, RequestTimings
from worker.engine.parameters import parameter_counts
from worker.engine.plan.make import make_plan
from worker.engine.plan.smoothing import smoothed
from worker.engine.sampler import apply_min_tokens, token_logprobs
from worker.engine.sampling_params import SamplingParams
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import Sequence, SequenceStatus
from worker.engine.speculation import DEFAULT_MAX_ROWS, Speculator
from worker.engine.stats import StatsRecorder
from worker.engine.step_cost import StepCost
from worker.engine.step_inputs import StepInputs, build_step_inputs, prompt_logprob_rows
from worker.engine.stopping import FinishChecker
from worker.engine.structured import StructuredDecoder
from worker.engine.verify import SampleGroup, accept_greedy_rows, next_tokens, sample_chunks
from worker.engine.weights import canonical_tensors

log = logging.getLogger(__name__)

LOGITS_CHUNK_BYTES = 96 * 2**20  # bounds the [rows, vocab] float32 logits held at once for prompt logprobs
# Logits a step makes and samples at once, in bytes: under glibc's largest mmap threshold (32 MiB), so the
# heap hands the same memory back step after step. A whole step's logits (256 rows of a 49,152-token
# vocabulary: 50 MB; 64 rows of Gemma's 262,144: 67 MB) were a fresh mapping every time, whose page faults
# cost ~10 ms a step on the 2-core VMs (as long as the LM head product itself on the AMX one).
SAMPLE_CHUNK_BYTES = 24 * 2**20


def sample_chunk_rows(vocab_size: int) -> int:
    """Logits rows per sampling chunk: 128 for SmolLM2's vocabulary, 24 for Gemma's."""
    return max(1, SAMPLE_CHUNK_BYTES // (4 * vocab_size))


def pick_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        """load -> plan -> build -> allocate -> ready to step."""
        self.config = config
        self.device = pick_device(config.device)
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)  # before the plan: it is measured at this thread count
        checkpoint = load_checkpoint(config.model, config.cache_dir)
        self.tokenizer, self.model_config = checkpoint.tokenizer, checkpoint.config
        self.max_model_len = min(config.max_model_len, self.model_config.max_position_embeddings)
        self.plan = make_plan(config, self.model_config, self.device, calibration_dir(config.cache_dir))
        self.dtype = DTYPES[self.plan.scheme.dtype]
        self.kv_dtype = config.kv_torch_dtype(self.dtype)
        self.model = self._build_model(checkpoint.tensors)
        self.numerics = self._numerics(checkpoint.path)
        del checkpoint  # the checkpoint's tensors go before the KV pool is sized (CUDA: from free memory)
        self._allocate_kv()
        self._prepare_steps()

    def _build_model(self, checkpoint_tensors: dict[str, torch.Tensor]) -> DecoderModel:
        """The model in the plan's scheme: canonical tensors, smoothed first for INT8 (plan/smoothing.py)."""
        config, plan = self.config, self.plan
        tensors = canonical_tensors(self.model_config, checkpoint_tensors)
        if plan.scheme.quantization == "int8" and config.smoothing:
            tensors = smoothed(self.model_config, tensors, self.tokenizer, self.dtype, self.device,
                               self.max_model_len, config.block_size)  # fmt: skip
        return DecoderModel(
            self.model_config, tensors, self.dtype, plan.scheme.quantization, self.device,
            max_positions=self.max_model_len, int8_backend=plan.scheme.int8_backend,
            small_batch_rows=plan.small_batch_rows, invariant_rows=plan.invariant_rows, wide_rows=plan.wide_rows,
            greedy_head=config.fused_greedy_head,
        )  # fmt: skip

    def _numerics(self, model_path: Path) -> NumericsIdentity:
        """What outputs depend on besides the request (a result cache's key: worker/shard/cache_key.py)."""
        scheme = self.plan.scheme
        return numerics_identity(
            model_path=model_path, device=self.device, tier=self.plan.tier, dtype=scheme.dtype,
            quantization=scheme.quantization, kv_dtype=self.kv_dtype, smoothing=self.config.smoothing,
            invariant_rows=self.plan.invariant_rows,
        )  # fmt: skip

    def _allocate_kv(self) -> None:
        """The KV pool (per KV group), its block managers, and the context the pool holds."""
        config, scheme = self.config, self.plan.scheme
        num_blocks = self._num_kv_blocks()  # per KV group
        self.kv_cache = KVCache(self.model_config, num_blocks, config.block_size, self.kv_dtype, self.device)
        if self.plan.attention is not None:
            self.kv_cache.compiled_decode = self.plan.attention.compiled_decode
            self.kv_cache.compiled_prefill = self.plan.attention.compiled_prefill
        # cached KV is only valid for the same weights and numerics: the salt seeds every block hash
        salt = f"{config.model}|{scheme.dtype}|{scheme.quantization}|{config.smoothing}|{self.kv_dtype}"
        groups, caching = self.kv_cache.groups, config.enable_prefix_caching
        self.kv_blocks = BlockCoordinator(
            [
                BlockManager(n, config.block_size, caching, salt, window=group.window, group=g)
                for g, (group, n) in enumerate(zip(groups, num_blocks, strict=True))
            ],
            layers=[len(group.layers) for group in groups],
        )
        self.blocks = self.kv_blocks.groups[0]  # KV group 0's manager: every layer's, without window layers
        wanted, self.max_model_len = self.max_model_len, self._context_in_pool()
        self.context_cut = self.max_model_len < wanted  # the KV pool, not the model or config, bounds it

    def _prepare_steps(self) -> None:
        """Scheduler, speculation, stats, finish checks and grammars: what every step uses."""
        config = self.config
        self.scheduler = Scheduler(config, self.kv_blocks)
        self.speculator = self._speculator() if config.enable_speculation and config.num_speculative_tokens else None
        # KV use in blocks of every layer (a window group's blocks weigh its share of the layers)
        counts = parameter_counts(self.model_config)
        self.stats = EngineStats(
            num_kv_blocks=self.kv_blocks.num_blocks, tier=self.plan.tier, paths=self.plan.paths(),
            parameters=counts.total, active_parameters=counts.active,
        )
        self._recorder = StatsRecorder(self.stats)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.finisher = FinishChecker(self.tokenizer, eos, self.max_model_len)
        self.structured = StructuredDecoder(self.tokenizer, self.model_config.vocab_size, sorted(eos))
        self._next_request_id = 0
        self._rejected: list[Sequence] = []
        self._fallback_generator = torch.Generator(device=self.device).manual_seed(0)

    def _speculator(self) -> Speculator:
        """Drafts priced by the small-batch measurement where there is one ("auto"), else bounded by rows."""
        k, max_len = self.config.num_speculative_tokens, self.max_model_len
        if self.config.speculation_max_rows != "auto":
            return Speculator(self.kv_blocks, k, max_len, max_rows=self.config.speculation_max_rows)
        cost = StepCost.from_measurement(self.plan.small_batch.fastest()) if self.plan.small_batch else None
        if cost is None:
            return Speculator(self.kv_blocks, k, max_len, max_rows=DEFAULT_MAX_ROWS)
        return Speculator(self.kv_blocks, k, max_len, step_cost=cost)

    def _num_kv_blocks(self) -> list[int]:
        """Blocks of each KV group's pool (attention.kv_groups) in the memory budget, or in the memory of
        num_kv_blocks blocks of every layer (without window layers: exactly num_kv_blocks)."""
        cfg, model = self.config, self.model_config
        per_layer_block = KVCache.bytes_per_layer_block(model, cfg.block_size, self.kv_dtype)
        groups = kv_groups(model)
        if cfg.num_kv_blocks is not None:
            return split_kv_blocks(groups, cfg.num_kv_blocks * model.num_layers, self._window_blocks(groups))
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * cfg.gpu_memory_utilization
        else:
            cpu = cpu_kv_budget(cfg.kv_cache_memory_gb)
            budget = cpu.bytes
            if cpu.cut:
                log.warning(
                    "KV cache cut from %.2f to %.2f GiB: %.2f GiB of memory is free after the model loaded",
                    cpu.asked_bytes / 2**30, cpu.bytes / 2**30, cpu.free_bytes / 2**30,
                )
        # more blocks than max_num_seqs full-length sequences would never be used
        useful = cfg.max_num_seqs * blocks_for(self.max_model_len, cfg.block_size)
        counts = split_kv_blocks(groups, int(budget // per_layer_block), self._window_blocks(groups), useful)
        if min(counts) < 1:
            per_block = per_layer_block * model.num_layers
            raise ValueError(f"KV cache budget {budget / 2**30:.3f} GiB holds no {per_block}-byte block")
        used = sum(n * per_layer_block * len(g.layers) for n, g in zip(counts, groups, strict=True))
        log.info(
            "KV cache: %s blocks of %d tokens per KV group, %.2f GiB of a %.2f GiB budget (%s)",
            "/".join(map(str, counts)), cfg.block_size, used / 2**30, budget / 2**30, self.kv_dtype,
        )
        return counts

    def _context_in_pool(self) -> int:
        """max_model_len cut to the longest sequence the KV pool holds, so a row asking for more output than
        fits runs to the pool's length (finish "length") instead of being refused. The rope tables keep the
        longer length (a LongRoPE model keeps the factor set picked for it)."""
        fit = self.kv_blocks.longest_fit(self.max_model_len)
        if fit < self.max_model_len:
            log.warning(
                "context cut from %d to %d tokens: the KV cache (%d blocks of %d tokens) holds no longer "
                "sequence; raise kv_cache_memory_gb for more", self.max_model_len, fit,
                self.kv_blocks.num_blocks, self.config.block_size,
            )
        return fit

    def _window_blocks(self, groups: list[KVGroup]) -> list[int]:
        """Per group, the blocks that hold every sequence the engine can run at once (0: full attention):
        max_num_seqs decodes, each reading its window plus a draft (a block more where the window straddles
        one), and the step's prefill chunks, which are written whole however long the window."""
        cfg = self.config
        draft = cfg.num_speculative_tokens if cfg.enable_speculation else 0
        longest = blocks_for(self.max_model_len, cfg.block_size)
        chunks = blocks_for(cfg.max_num_batched_tokens, cfg.block_size)
        return [
            min(cfg.max_num_seqs * min(longest, blocks_for(g.window - 1 + draft, cfg.block_size) + 1) + chunks,
                cfg.max_num_seqs * longest) if g.window else 0
            for g in groups
        ]  # fmt: skip

    def add_request(self, index: int, prompt_token_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(
            request_id=self._next_request_id,
            index=index,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            timings=RequestTimings(queued=time.monotonic()),
        )
        self._next_request_id += 1
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        error = self._why_unfit(seq)
        if not error and params.structured is not None:
            error = self.structured.attach(seq)  # compiles the constraint once per engine
        if error:
            self._finish(seq, "error", error)
            self._rejected.append(seq)
        else:
            self.stats.prompt_tokens += seq.num_prompt_tokens
            self.scheduler.add(seq)
        return seq

    def _why_unfit(self, seq: Sequence) -> str | None:
        n = seq.num_prompt_tokens
        if n == 0:
            return "empty prompt: it has no tokens"
        if n >= self.max_model_len:
            why = " (all the KV cache holds: raise kv_cache_memory_gb)" if self.context_cut else ""
            return (f"prompt has {n} tokens; max_model_len is {self.max_model_len}{why}, which leaves no room "
                    "for output")
        vocab = self.model_config.vocab_size
        if min(seq.prompt_token_ids) < 0 or max(seq.prompt_token_ids) >= vocab:
            return f"prompt token ids must be in [0, {vocab})"
        return None

    def has_unfinished(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished request (cancellation)."""
        self._rejected.clear()
        return self.scheduler.drain()

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """Run one engine step; return the sequences that finished in it."""
        finished, self._rejected = self._rejected, []
        if not self.scheduler.has_unfinished():
            return finished
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        self.stats.preemptions += len(scheduled.preempted)
        self.stats.cached_prompt_tokens += scheduled.cached_tokens
        if scheduled.is_empty:
            raise RuntimeError("scheduler made no progress; the KV pool is too small for any waiting request")
        if self.speculator is not None:
            self.speculator.propose(
                scheduled, self.config.max_num_batched_tokens, num_waiting=self.scheduler.num_waiting
            )
        inputs = build_step_inputs(scheduled, self.kv_blocks, self.device)
        hidden = self.model.forward(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache)
        for chunk, offset in zip(scheduled.prefills, inputs.prefill_offsets, strict=True):
            if chunk.seq.params.prompt_logprobs:
                self._collect_prompt_logprobs(hidden, chunk, offset)
        for seq in scheduled.decodes:
            if seq not in scheduled.drafts:  # speculating ones are settled once their draft is verified
                seq.num_computed_tokens += 1
                self.kv_blocks.register_full(seq, seq.num_computed_tokens - 1, seq.num_computed_tokens)
        for chunk in scheduled.prefills:
            chunk.seq.num_computed_tokens = chunk.end
            self.kv_blocks.register_full(chunk.seq, chunk.start, chunk.end)
        done, rejected_rows = self._sample(hidden, inputs)
        finished.extend(done)
        for seq in finished:
            if seq in self.scheduler.running:
                self.scheduler.remove_finished(seq)
        self._recorder.record_step(
            # rows of rejected draft tokens ran through the model but left no K/V (draft_tokens counts them)
            num_tokens=scheduled.num_tokens - rejected_rows,
            running=len(scheduled.decodes) + len(scheduled.prefills),
            kv_blocks_used=self.kv_blocks.num_used,  # blocks of every layer (window groups weighted)
            peak_kv_blocks_used=self.kv_blocks.peak_used,
            seconds=time.perf_counter() - started,
        )
        return finished

    def _collect_prompt_logprobs(self, hidden: torch.Tensor, chunk, offset: int) -> None:
        rows, targets = prompt_logprob_rows(chunk, offset)
        step = max(1, LOGITS_CHUNK_BYTES // (4 * self.model_config.vocab_size))  # 512 rows of SmolLM2's
        for i in range(0, len(rows), step):
            part = rows[i : i + step]
            logits = self.model.logits(hidden[part])
            target = torch.tensor(targets[i : i + step], device=self.device)
            chunk.seq.prompt_logprobs.extend(token_logprobs(logits, target))

    def _sample(self, hidden: torch.Tensor, inputs: StepInputs) -> tuple[list[Sequence], int]:
        """Emit each sampling sequence's tokens (verify.py); return the finished sequences and the rows
        of draft tokens that were computed in vain."""
        seqs, drafts = inputs.sample_seqs, inputs.sample_drafts
        chosen: list[list[int]] = []
        logprobs: list[list[float]] = []
        if self.model.fused_greedy and all(self._plain_greedy(s) for s in seqs):
            chosen = accept_greedy_rows(drafts, self.model.greedy_picks(hidden[inputs.sample_rows]))
            logprobs = [[] for _ in seqs]
        else:
            for some, rows in sample_chunks(drafts, sample_chunk_rows(self.model_config.vocab_size)):
                tokens, values = self._choose(hidden[inputs.sample_rows[rows]], seqs[some], drafts[some])
                chosen += tokens
                logprobs += values
        finished, rejected_rows = [], 0
        now = time.monotonic()
        for seq, draft, tokens, values in zip(seqs, drafts, chosen, logprobs, strict=True):
            start = seq.num_computed_tokens
            if self._emit(seq, tokens, values, now):
                finished.append(seq)
            if draft:
                self.stats.draft_tokens += len(draft)
                self.stats.accepted_draft_tokens += len(tokens) - 1
                computed = self.speculator.settle(seq, start, len(draft), len(tokens) - 1)
                rejected_rows += 1 + len(draft) - computed
        return finished, rejected_rows

    def _plain_greedy(self, seq: Sequence) -> bool:
        """Its tokens are the logits' argmax alone: greedy, no logprobs, no grammar mask, no ban yet (a draft's
        later rows are banned only if its first is: min_tokens counts up)."""
        params = seq.params
        return params.greedy and not params.logprobs and params.structured is None and not self.finisher.banned_tokens(seq)

    def _choose(
        self, hidden: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The tokens (and their logprobs, where asked) that consecutive sequences emit from their rows of
        `hidden` [sum(1 + len(draft)), hidden_size]."""
        logits = self.model.logits(hidden)  # [rows, vocab] float32
        apply_min_tokens(logits, [
            self.finisher.banned_tokens(s, len(s.output_token_ids) + j)
            for s, d in zip(seqs, drafts, strict=True) for j in range(1 + len(d))
        ])  # fmt: skip
        if any(s.params.structured is not None for s in seqs):  # unconstrained steps do no mask work
            self.structured.apply_masks(logits, seqs, drafts)
        groups = [SampleGroup(s.params, s.generator, d) for s, d in zip(seqs, drafts, strict=True)]
        chosen = next_tokens(logits, groups, self._fallback_generator)
        firsts = [0]  # first logits row of each sequence
        for d in drafts:
            firsts.append(firsts[-1] + 1 + len(d))
        return chosen, self._logprobs(logits, seqs, chosen, firsts)

    def _logprobs(
        self, logits: torch.Tensor, seqs: list[Sequence], chosen: list[list[int]], firsts: list[int]
    ) -> list[list[float]]:
        """Logprob of each chosen token, for the sequences that asked (one batched call)."""
        rows, tokens = [], []
        for i, seq in enumerate(seqs):
            if seq.params.logprobs:
                rows.extend(range(firsts[i], firsts[i] + len(chosen[i])))
                tokens.extend(chosen[i])
        values = token_logprobs(logits[rows], torch.tensor(tokens, device=self.device)) if rows else []
        out, used = [], 0
        for seq, picked in zip(seqs, chosen, strict=True):
            n = len(picked) if seq.params.logprobs else 0
            out.append(values[used : used + n])
            used += n
        return out

    def _emit(self, seq: Sequence, tokens: list[int], logprobs: list[float], now: float) -> bool:
        """Append tokens one at a time through the finish checks; the first finish drops the rest."""
        if seq.timings.first_token is None:
            seq.timings.first_token = now
        for i, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            if seq.params.logprobs:
                seq.logprobs.append(logprobs[i])
            self.stats.output_tokens += 1
            reason, error = self.finisher.check(seq), None
            if reason is None and seq.params.structured is not None:
                reason, error = self.structured.advance(seq, token)
            if reason:
                self._finish(seq, reason, error)
                return True
        return False

    def _finish(self, seq: Sequence, reason: str, error: str | None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]
        seq.error = error
        seq.timings.finished = time.monotonic()

    def to_output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            index=seq.index,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            text=self.finisher.final_text(seq),
            finish_reason=seq.finish_reason or "error",
            error=seq.error,
            logprobs=seq.logprobs if seq.params.logprobs else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs else None,
            timings=seq.timings,
        )
