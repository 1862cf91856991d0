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
from worker.engine.path_plan import plan_cpu_kernels, plan_for


def doctor_report(
    *, model: str, dtype: str, quantization: str | None, cache_dir: str | None, max_num_seqs: int
) -> dict[str, Any]:
    config = EngineConfig(model=model, dtype=dtype, quantization=quantization, cache_dir=cache_dir,
                          max_num_seqs=max_num_seqs)  # fmt: skip
    model_config = ModelConfig.from_hf(AutoConfig.from_pretrained(resolve_model_path(model, cache_dir)))
    device = pick_device(config.device)
    plan = plan_for(config, model_config, device, calibration_dir(cache_dir))
    if device.type == "cpu":
        plan_cpu_kernels(plan, config, model_config, calibration_dir(cache_dir))
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
        "model": model,
        "requested": {"dtype": dtype, "quantization": quantization},
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
    lines.append("paths")
    lines += [f"  {op:<24} {path}" for op, path in plan["paths"].items()]
    return "\n".join(lines)
