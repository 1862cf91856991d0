"""`freight doctor`: the machine and the path the engine takes for every op, without loading weights."""

from __future__ import annotations

from typing import Any

import torch
from transformers import AutoConfig

from kernels import cpu_decode_attention, cpu_int8_linear, cpu_int8_small_batch, cpu_prefill_attention
from kernels.platform import describe
from worker.engine.config import EngineConfig, ModelConfig
from worker.engine.engine import pick_device
from worker.engine.loader import calibration_dir, resolve_model_path
from worker.engine.plan.make import make_plan


def doctor_report(config: EngineConfig) -> dict[str, Any]:
    """The machine and the plan `config` gets here (the same make_plan as a load, without the weights). The
    CLI builds `config` from the worker's engine settings (jobs.domain.engine_settings.engine_options_of),
    so doctor plans with exactly the options a worker loads with."""
    model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model_path(config.model, config.cache_dir)))
    if config.num_threads and pick_device(config.device).type == "cpu":
        torch.set_num_threads(config.num_threads)  # as the engine does before it plans
    plan = make_plan(config, model_config, pick_device(config.device), calibration_dir(config.cache_dir))
    return {
        "machine": describe(),
        "compiled_kernels": {
            "decode_attention": cpu_decode_attention.available(),
            "int8_linear": cpu_int8_linear.available(),
            "int8_small_batch": cpu_int8_small_batch.available(),
            "int8_small_batch_amx": cpu_int8_small_batch.amx_enabled(),
            "prefill_attention_float32": cpu_prefill_attention.available(torch.float32),
            "prefill_attention_bfloat16": cpu_prefill_attention.available(torch.bfloat16),
        },
        "model": config.model,
        "requested": {"dtype": config.dtype, "quantization": config.quantization},
        "plan": plan.to_json(),
    }


def format_report(report: dict[str, Any]) -> str:
    machine, plan = report["machine"], report["plan"]
    kernels = ", ".join(f"{op}: {'built' if ok else 'not built'}" for op, ok in report["compiled_kernels"].items())
    forced = "" if machine["tier"] == machine["native_tier"] else f" (forced; native {machine['native_tier']})"
    lines = [
        f"CPU        {machine['cpu']} ({machine['arch']}), {machine['cores']} cores, {machine['threads']} threads",
        f"ISA tier   {machine['tier']}{forced}; extensions: {' '.join(machine['extensions']) or '-'}",
        f"caches     {', '.join(f'{k} {v}' for k, v in machine['caches'].items()) or '-'}",
        f"torch      {machine['torch']}, CPU capability {machine['torch_cpu_capability']}",
        f"CUDA       {machine['cuda'] or 'none'}",
        f"kernels    {kernels}",
        f"model      {report['model']} (requested dtype={report['requested']['dtype']}, "
        f"quantization={report['requested']['quantization']})",
        f"scheme     {plan['scheme']} ({plan['source']}; fastest measured: {plan['best'] or '-'})",
    ]
    for name, seconds in sorted(plan["seconds_per_token"].items(), key=lambda item: item[1]):
        lines.append(f"  {name:<26} {seconds * 1e6:9.1f} us per token (every layer + LM head, mean of prefill and decode)")
    if plan.get("small_batch"):
        small = plan["small_batch"]
        lines.append(f"small batch INT8 kernel up to {small['rows']} rows (one pass over the sampled layers, ms):")
        for rows in sorted({int(key.split("/")[0]) for key in small["seconds"]}):
            ours, library = small["seconds"][f"{rows}/small"], small["seconds"][f"{rows}/library"]
            lines.append(f"  {rows:>4} rows   small-batch {ours * 1e3:7.2f}   library GEMM {library * 1e3:7.2f}")
    if plan.get("invariant_rows"):
        wide = ", ".join(str(r) for r in plan["wide_rows"]) or "none"
        lines.append(f"invariance float products in blocks of {plan['invariant_rows']} rows (wider: {wide})")
    lines.append("paths")
    lines += [f"  {op:<24} {path}" for op, path in plan["paths"].items()]
    return "\n".join(lines)
