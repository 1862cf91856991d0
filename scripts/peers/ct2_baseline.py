"""CTranslate2 as a peer of `freight bench`: Generator.generate_batch over a workload Parquet.

Run it with the python of CTranslate2's venv (scripts/peers/setup.sh). Contract and report:
peer_common.py. The model is converted once with INT8 weights (`--convert HF --out DIR`, the same as
`ct2-transformers-converter --model HF --output_dir DIR --quantization int8`); --compute-type picks
how it runs (int8: INT8 GEMMs with float32 activations; int8_float32 is the same on CPU; float32
dequantizes the weights at load).

CTranslate2 has no continuous batching: generate_batch sorts the requests by length and runs them in
static batches of --max-batch-size, each until its longest request is done. Prompts go in as tokens
(the converted vocabulary's strings of the workload's ids, which map back to the same ids since no
string is there twice), greedy (sampling_topk=1), and EOS cannot end a request before max_tokens
(min_length = max_length = max_tokens; the count is checked after).

Defaults (2 cores, AVX-512 + VNNI, SmolLM2-135M, 2026-12-07): compute type int8 (the CPU build offers
int8, int8_float32 and float32 here; no bfloat16), max_batch_size 32, inter_threads 1 (one batch at a
time on every core). Not swept on a quiet machine yet.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from peer_common import Timer, Workload, convert_atomically, parser, report, run_or_convert


def convert(hf_folder: str, out: str) -> None:
    from ctranslate2.converters import TransformersConverter

    def build(tmp: Path) -> None:
        TransformersConverter(hf_folder).convert(str(tmp), quantization="int8", force=True)

    convert_atomically(out, build)


def vocabulary(model: str) -> list[str]:
    folder = Path(model)
    if (folder / "vocabulary.json").is_file():
        return json.loads((folder / "vocabulary.json").read_text())
    return (folder / "vocabulary.txt").read_text(encoding="utf-8").split("\n")


def main() -> None:
    ap = parser(__doc__.split("\n")[0])
    ap.add_argument("--compute-type", default="int8", help="int8, int8_float32, float32, ... (default int8)")
    ap.add_argument("--max-batch-size", type=int, default=32, help="requests per static batch")
    ap.add_argument("--inter-threads", type=int, default=1,
                    help="batches run side by side (the cores are split between them)")  # fmt: skip
    run_or_convert(ap, convert, run)


def run(args: argparse.Namespace, workload: Workload, threads: int) -> None:
    import ctranslate2

    timer = Timer()
    generator = ctranslate2.Generator(
        args.model, device="cpu", compute_type=args.compute_type, inter_threads=args.inter_threads,
        intra_threads=max(1, threads // args.inter_threads),
    )  # fmt: skip
    vocab = vocabulary(args.model)
    load_s = timer()
    if len(set(vocab)) != len(vocab):  # a string that two ids share would map back to one of them
        raise SystemExit("the converted vocabulary has duplicate strings: token ids cannot round-trip")
    prompts = [[vocab[i] for i in ids] for ids in workload.prompts]

    outputs: list[list[int]] = [[] for _ in range(len(workload))]
    timer = Timer()
    for max_tokens in sorted(set(workload.max_tokens)):  # one generate_batch per output length
        rows = [i for i, m in enumerate(workload.max_tokens) if m == max_tokens]
        results = generator.generate_batch(
            [prompts[i] for i in rows], max_batch_size=args.max_batch_size, batch_type="examples",
            beam_size=1, sampling_topk=1, max_length=max_tokens, min_length=max_tokens,
            include_prompt_in_result=False,
        )  # fmt: skip
        for row, result in zip(rows, results, strict=True):
            outputs[row] = list(result.sequences_ids[0])
    elapsed = timer()

    settings = {
        "engine": "ctranslate2",
        "ctranslate2": ctranslate2.__version__,
        "compute_type": args.compute_type,
        "max_batch_size": args.max_batch_size,
        "inter_threads": args.inter_threads,
        "intra_threads": max(1, threads // args.inter_threads),
    }
    report(args, workload, outputs, elapsed, load_s, settings)


if __name__ == "__main__":
    main()
