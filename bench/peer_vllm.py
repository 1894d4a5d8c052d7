"""The vLLM side of `pdserve bench peer`, run by the Python of vLLM's own venv (never imported by pdserve).

Reads one JSON command per line on stdin and answers one JSON line on stdout, so that the bench process can alternate
sides without either engine running while the other is timed. vLLM's own logs go to stderr."""

import json
import os
import sys
import time


def _decode(llm, prompts, new_tokens, SamplingParams):
    """Tokens after the first over the time after the first: the same definition as the pdserve side."""
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"d{time.monotonic_ns()}-{i}", {"prompt_token_ids": ids}, sp)
    started, done = set(), {}
    t0 = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                done[out.request_id] = len(out.outputs[0].token_ids)
        if t0 is None and len(started) == len(prompts):
            t0 = time.perf_counter()
    elapsed = time.perf_counter() - t0
    return {"tokens": sum(n - 1 for n in done.values()), "seconds": elapsed}


def main() -> int:
    cfg = json.loads(sys.argv[1])
    # Answers get the real stdout; everything vLLM prints (its logger writes to stdout) goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=cfg["model"],
        dtype=cfg["dtype"],
        max_model_len=cfg["max_model_len"],
        max_num_seqs=cfg["max_num_seqs"],
        enable_prefix_caching=False,
        seed=0,
    )
    import vllm

    print(json.dumps({"ready": True, "version": vllm.__version__}), file=answers, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "prefill":
            sp = SamplingParams(temperature=0.0, max_tokens=1)
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": cmd["ids"]}], sp, use_tqdm=False)
            answer = {"seconds": time.perf_counter() - t0}
        elif cmd["op"] == "decode":
            answer = _decode(llm, cmd["prompts"], cmd["new_tokens"], SamplingParams)
        elif cmd["op"] == "quit":
            print(json.dumps({"bye": True}), file=answers, flush=True)
            break
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(answer), file=answers, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
