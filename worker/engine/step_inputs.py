"""Flatten a scheduled step into packed model inputs: no padding, decodes first.

Token ids, positions, decode context lengths and prefill query ranges are the step's; slot mappings and
block tables are each KV group's (block_manager.BlockCoordinator), group 0's in the metadata's own fields.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.attention import AttentionMetadata, GroupTables
from worker.engine.block_manager import BlockCoordinator, BlockManager
from worker.engine.scheduler import PrefillChunk, SchedulerOutput
from worker.engine.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    sample_rows: list[int]  # rows whose logits are sampled: each sampling sequence's last token, then its draft
    sample_seqs: list[Sequence]
    sample_drafts: list[list[int]]  # per sampling sequence, the draft its rows after the first score
    prefill_offsets: list[int]  # first row of each prefill chunk


def _block_tables(tables: list[list[int]], device: torch.device, window: int = 0) -> torch.Tensor:
    """[rows, max_blocks] int32. Entries past a sequence's length are never read by the kernels, nor are a
    window group's placeholders (blocks before every query's window): 0 keeps them in range."""
    width = max(len(t) for t in tables)
    out = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
    return out.clamp_(min=0) if window else out


def _group_tables(out: SchedulerOutput, group: BlockManager, device: torch.device) -> GroupTables:
    """A further KV group's slots and tables, in the rows of build_step_inputs."""
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    for seq in out.decodes:
        table = group.table(seq)
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + 1 + len(out.drafts.get(seq, []))):
            slots.append(group.slot(seq, pos))
            decode_tables.append(table)
    for chunk in out.prefills:
        slots.extend(group.slot(chunk.seq, p) for p in range(chunk.start, chunk.end))
    return GroupTables(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        decode_block_tables=_block_tables(decode_tables, device, group.window) if out.decodes else None,
        prefill_block_tables=_block_tables([group.table(c.seq) for c in out.prefills], device, group.window)
        if out.prefills else None,
    )


def build_step_inputs(
    out: SchedulerOutput, blocks: BlockCoordinator | BlockManager, device: torch.device
) -> StepInputs:
    groups = blocks.groups if isinstance(blocks, BlockCoordinator) else [blocks]
    first = groups[0]
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    decode_tables: list[list[int]] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    sample_drafts: list[list[int]] = []
    for seq in out.decodes:
        # a draft's tokens are decode rows too: row j attends to the context up to its own position, whose
        # K/V this step writes before attending, so k + 1 rows score what k + 1 decode steps would; the rows
        # stay adjacent with one block table, which the CPU kernel reads as one run (one pass over the cache)
        draft = out.drafts.get(seq, [])
        start = seq.num_computed_tokens
        for pos, token in enumerate([seq.token_at(start), *draft], start=start):
            sample_rows.append(len(ids))
            ids.append(token)
            positions.append(pos)
            slots.append(first.slot(seq, pos))
            decode_tables.append(seq.block_tables[0])
        sample_seqs.append(seq)
        sample_drafts.append(draft)
    num_decodes = len(ids)

    query_start_loc = [0]
    prefill_offsets: list[int] = []
    for chunk in out.prefills:
        prefill_offsets.append(len(ids))
        ids.extend(chunk.seq.tokens(chunk.start, chunk.end))
        span = range(chunk.start, chunk.end)
        positions.extend(span)
        slots.extend(first.slot(chunk.seq, p) for p in span)
        query_start_loc.append(query_start_loc[-1] + chunk.num_tokens)
        if chunk.samples:
            sample_rows.append(len(ids) - 1)
            sample_seqs.append(chunk.seq)
            sample_drafts.append([])

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    prefill_seqs = [c.seq for c in out.prefills]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode_tokens=num_decodes,
        decode_block_tables=_block_tables(decode_tables, device, first.window) if out.decodes else None,
        decode_context_lens=i32([p + 1 for p in positions[:num_decodes]]) if out.decodes else None,
        prefill_block_tables=_block_tables([s.block_tables[0] for s in prefill_seqs], device, first.window)
        if prefill_seqs else None,
        prefill_query_start_loc=i32(query_start_loc) if prefill_seqs else None,
        prefill_seq_lens=i32([c.end for c in out.prefills]) if prefill_seqs else None,
        other_groups=tuple(_group_tables(out, group, device) for group in groups[1:]),
    )
    return StepInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        sample_rows=sample_rows,
        sample_seqs=sample_seqs,
        sample_drafts=sample_drafts,
        prefill_offsets=prefill_offsets,
    )


def prompt_logprob_rows(chunk: PrefillChunk, offset: int) -> tuple[list[int], list[int]]:
    """Rows whose logits score prompt tokens, and the prompt tokens they score.

    Row of position p predicts token p + 1; only prompt tokens after the first are scored, each once
    (a sequence recomputed after preemption skips what it already has).
    """
    seq = chunk.seq
    first = max(chunk.start, len(seq.prompt_logprobs))
    last = min(chunk.end, seq.num_prompt_tokens - 1)
    positions = range(first, last)
    rows = [offset + p - chunk.start for p in positions]
    targets = [seq.prompt_token_ids[p + 1] for p in positions]
    return rows, targets
