"""`pdserve offline` (in this process) — the engine answering a prompt without any service."""

from __future__ import annotations

import argparse
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("offline", help="answer a prompt with the engine in this process (no cluster)")
    p.add_argument("prompt", nargs="?", default="What is the capital of France?")
    p.add_argument("--model", help="HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", type=int, default=1)
    p.set_defaults(func=run_offline)


def run_offline(args: argparse.Namespace) -> int:
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    with LLMEngine(
        EngineConfig(
            model=args.model,
            tensor_parallel_size=args.tensor_parallel_size,
            decode_context_parallel_size=args.decode_context_parallel_size,
        )
    ) as eng:
        prompt = (
            args.prompt if args.raw else eng.tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}])
        )
        rid = eng.add_request(prompt, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens))
        while eng.has_unfinished():
            for out in eng.step():
                if out.request_id == rid:
                    sys.stdout.write(out.text_delta)
                    sys.stdout.flush()
        sys.stdout.write("\n")
    return 0
