"""The mixture-of-experts block of Qwen3-MoE and Mixtral: a router picks top-k experts per token, each a
gated MLP of its own; the block's output is the routing-weighted sum of the chosen experts' outputs.

Routing follows transformers' order of operations exactly (Qwen3MoeTopKRouter, MixtralTopKRouter): router
logits in float32, softmax in float32, top-k, then (norm_topk_prob; always for Mixtral) the top-k weights
divided by their sum. The experts then run grouped rather than per token: the (token, slot) pairs are sorted
by expert and each expert that got tokens runs one gate/up and one down product over its rows, so a step
costs one product pair per active expert (at most tokens * k of them), and no Python loop runs per token.
Each expert's projections are ordinary Linears (quantization.make_linear): float, or INT8 with the CPU GEMMs,
the small-batch kernel for the few rows a decode step routes to an expert, and int8_linear's Triton path on
CUDA. Everything here is device-agnostic torch (argsort, bincount, gather, index writes), so the block runs
on CUDA tensors as well; the one host sync is the per-expert row counts.

The weighted outputs are summed per token in ascending expert order, starting from the lowest expert's:
transformers adds them with index_add_ into zeros, expert by expert, so float32 results are bit-equal
given equal expert outputs.
"""

from __future__ import annotations

import torch

from worker.engine.quantization import FloatLinear, Linear, gated


class MoEBlock:
    def __init__(
        self,
        router: FloatLinear,  # hidden -> experts, float32 in and out
        gate_up: list[Linear],  # per expert: hidden -> 2 * moe_intermediate (gate rows, then up rows)
        down: list[Linear],  # per expert: moe_intermediate -> hidden
        top_k: int,
        norm_topk_prob: bool,
        activation: str = "silu",
    ) -> None:
        if len(gate_up) != len(down) or not 0 < top_k <= len(gate_up):
            raise ValueError(f"{len(gate_up)} gate_up, {len(down)} down projections and top_k {top_k}")
        self.router = router
        self.gate_up = gate_up
        self.down = down
        self.num_experts = len(gate_up)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.activation = activation

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[tokens, hidden] -> (weights [tokens, k] float32, experts [tokens, k] int64), each row's slots in
        ascending expert order."""
        logits = self.router(x.float())  # [tokens, experts] float32
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:  # summed in top-k order, as transformers does
            weights = weights / weights.sum(dim=-1, keepdim=True)
        experts, order = experts.sort(dim=-1)
        return weights.gather(-1, order), experts

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, hidden], plus residual when given (residual + block, transformers' order)."""
        tokens, hidden = x.shape
        if tokens == 0:
            out = x.new_zeros(0, hidden)
            return out if residual is None else residual + out
        weights, experts = self.route(x)
        k = self.top_k
        flat = experts.reshape(-1)  # [tokens * k], pair p = token p // k, slot p % k
        pairs = torch.argsort(flat, stable=True)  # pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, pairs // k)  # [tokens * k, hidden], grouped by expert
        grouped = torch.empty_like(rows)
        start = 0
        for expert, n in enumerate(counts):
            if n:
                part = rows[start : start + n]
                grouped[start : start + n] = self.down[expert](
                    gated(self.gate_up[expert], part, self.activation)
                )
                start += n
        # weight each pair's output (float32 weights, as transformers multiplies), back into pair order
        grouped = (grouped * weights.reshape(-1)[pairs, None]).to(x.dtype)
        per_pair = torch.empty_like(grouped)
        per_pair[pairs] = grouped
        per_pair = per_pair.view(tokens, k, hidden)
        out = per_pair[:, 0]
        for slot in range(1, k):  # ascending expert order per token (transformers' index_add_ order)
            out = out + per_pair[:, slot]
        return out if residual is None else residual + out


def naive_moe(
    x: torch.Tensor,
    router: torch.Tensor,  # [experts, hidden]
    gate_up: torch.Tensor,  # [experts, 2 * intermediate, hidden]
    down: torch.Tensor,  # [experts, hidden, intermediate]
    top_k: int,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """A per-token reference of the block (tests): each token's top-k experts one by one, in float64."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64)
    probs = torch.softmax(x64 @ router.double().T, dim=-1)
    for t in range(x.shape[0]):
        weights, experts = torch.topk(probs[t], top_k)
        if norm_topk_prob:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist(), strict=True):
            gate, up = (gate_up[e].double() @ x64[t]).chunk(2)
            out[t] += w * (down[e].double() @ (torch.nn.functional.silu(gate) * up))
    return out
