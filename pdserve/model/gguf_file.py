"""A GGUF file (llama.cpp's format) as the model path: its config through transformers' GGUF support, its weights
through the gguf package's reader. Llama-architecture files only (Llama, Mistral, SmolLM2 as llama.cpp converts them).

Q8_0 tensors load as they are into int8 layers: a Q8_0 block is one fp16 scale and 32 int8 values over 32
consecutive input columns of a row, which is quant.py's layout (GROUP columns per float32 scale; fp16 -> float32 is
exact), so a Q8_0 file is served with llama.cpp's own int8 values and scales, and implies int8 execution whatever
--quantization says. F32 / F16 / BF16 tensors load as floats (quantised at load where they feed an int8 layer, as
--quantization int8 does); a Q8_0 tensor feeding a float destination (the embedding) is de-quantised, which is exact
in float32. Other GGUF types (Q4_1, the K-quants, ...) are refused: pdserve has no kernels for them, and
re-quantising their de-quantised values to Q8_0 would serve neither llama.cpp's weights nor the original ones.

llama.cpp's converter permutes the rows of Q and K within each head for its rope layout (LlamaModel.permute in
convert_hf_to_gguf.py); loading undoes it as transformers' GGUF loader does, on the int8 rows together with their
block scales, so the reordering is exact. The LM head is the file's Q8_0 output matrix (or the Q8_0 token embedding
it is tied to), per vocab shard (lm_head_q8_0).

gguf and transformers are imported only when a GGUF file is given: the runtime image carries neither."""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np
import torch

from pdserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfigError
from pdserve.model.deepseek import DeepseekCausalLM
from pdserve.model.linear import INT8_GROUP, Int8Weight
from pdserve.model.llama import CausalLM
from pdserve.model.quant import scales_by_storage
from pdserve.model.weights import WeightLoadError, store, store_blocks, targets_of

if TYPE_CHECKING:
    import gguf

# the tensor types pdserve reads (GGMLQuantizationType names): Q8_0 into int8 layers, the float ones as floats
READABLE = ("Q8_0", "F32", "F16", "BF16")
_ARCHS = {"llama": "LLAMA"}  # general.architecture -> gguf.MODEL_ARCH member
_FAMILY_ARCH = {family: arch for arch, family in SUPPORTED_ARCHITECTURES.items()}


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix == ".gguf"


def _gguf_needs(package: str) -> NoReturn:
    raise ModelConfigError(
        f"a GGUF model needs the {package} package (a pdserve dependency that the runtime image leaves out): pip "
        f"install {package}, or give the HF checkpoint directory"
    )


def _gguf() -> ModuleType:
    try:
        import gguf
    except ImportError:
        _gguf_needs("gguf")
    return gguf


def _is_q8_0(t: gguf.ReaderTensor) -> bool:
    return t.tensor_type.name == "Q8_0"


def _stamp(path: str | Path) -> tuple[str, int, int]:
    """What the per-process caches are keyed on: the file, and its size and time so a rewritten file is read anew."""
    p = Path(path)
    try:
        st = os.stat(p)
    except OSError as e:
        raise ModelConfigError(f"{p}: cannot read the GGUF file ({e.strerror})") from None
    return str(p.resolve()), st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _reader(path: str, size: int, mtime_ns: int) -> gguf.GGUFReader:
    g = _gguf()
    try:
        return g.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ModelConfigError(f"{path}: not a readable GGUF file ({e})") from None


def reader(path: str | Path) -> gguf.GGUFReader:
    """The file's reader (memory-mapped; parsing the metadata of a large vocabulary takes seconds, so one per
    process and file)."""
    return _reader(*_stamp(path))


def _arch(path: str | Path, r: gguf.GGUFReader) -> str:
    field = r.get_field(_gguf().Keys.General.ARCHITECTURE)
    arch = field.contents() if field is not None else None
    if arch not in _ARCHS:
        raise ModelConfigError(
            f"{Path(path).name}: GGUF architecture {arch!r} is not supported; pdserve reads GGUF files of "
            f"architecture {', '.join(sorted(_ARCHS))}, or give the HF checkpoint directory"
        )
    return str(arch)


def check_types(path: str | Path, r: gguf.GGUFReader) -> None:
    """Refuse a file with a tensor of a type pdserve does not read, naming the tensor and its type."""
    for t in r.tensors:
        if t.tensor_type.name not in READABLE:
            raise ModelConfigError(
                f"{Path(path).name}: tensor {t.name!r} is GGUF type {t.tensor_type.name}; pdserve reads GGUF "
                f"tensors of types {', '.join(READABLE)} (llama.cpp's convert_hf_to_gguf.py "
                "--outtype q8_0 writes such a file), or give the HF checkpoint directory"
            )


@functools.lru_cache(maxsize=4)
def _config(path: str, size: int, mtime_ns: int) -> dict[str, Any]:
    r = _reader(path, size, mtime_ns)
    _arch(path, r)
    check_types(path, r)
    if any(t.name == "rope_freqs.weight" for t in r.tensors):  # the rope scaling would be silently lost
        raise ModelConfigError(
            f"{Path(path).name}: holds rope_freqs (llama.cpp's per-frequency rope factors, Llama 3.1-style scaling), "
            "which pdserve does not read from GGUF; give the HF checkpoint directory"
        )
    try:
        from transformers import AutoConfig
    except ImportError:
        _gguf_needs("transformers")
    p = Path(path)
    raw = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()
    raw.pop("quantization_config", None)  # the weights' types are read per tensor, not from a config
    if not raw.get("architectures") and raw.get("model_type") in _FAMILY_ARCH:
        raw["architectures"] = [_FAMILY_ARCH[raw["model_type"]]]
    return raw


def read_config(path: str | Path) -> dict[str, Any]:
    """config.json's fields of the file, as transformers reads them from its metadata (after refusing an
    architecture or tensor type pdserve does not read)."""
    return copy.deepcopy(_config(*_stamp(path)))


def holds_q8_0(path: str | Path) -> bool:
    """Whether a decoder layer's tensor is Q8_0: the file is then served int8 (W8A8)."""
    return any(_is_q8_0(t) and t.name.startswith("blk.") for t in reader(path).tensors)


def q8_0_blocks(t: gguf.ReaderTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor's int8 values [N, K] and float32 block scales [N, K / 32], as the file holds them."""
    block, nbytes = _gguf().GGML_QUANT_SIZES[t.tensor_type]
    assert block == INT8_GROUP, "a Q8_0 block is pdserve's int8 block"
    rows = int(np.prod(t.data.shape[:-1]))
    blocks = t.data.reshape(rows, -1, nbytes)
    scale = np.ascontiguousarray(blocks[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return torch.from_numpy(q), torch.from_numpy(scale)


def _floats(t: gguf.ReaderTensor) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor as float32 (exact), in HF's shape order."""
    return torch.from_numpy(np.array(_gguf().quants.dequantize(t.data, t.tensor_type), dtype=np.float32))


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's LlamaModel.permute on the rows of w (a weight, its block scales, or a bias)."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _permuted_heads(name: str, model: CausalLM | DeepseekCausalLM) -> int | None:
    """The head count llama.cpp permuted the rows of tensor `name` by (Q: query heads, K: KV heads), or None."""
    if ".attn_q." in name:
        return model.cfg.num_heads
    if ".attn_k." in name:
        return model.cfg.num_kv_heads
    return None


def _names(path: str | Path, model: CausalLM | DeepseekCausalLM) -> tuple[dict[str, gguf.ReaderTensor], Any]:
    r = reader(path)
    arch = _arch(path, r)
    check_types(path, r)
    g = _gguf()
    return {t.name: t for t in r.tensors}, g.get_tensor_name_map(g.MODEL_ARCH[_ARCHS[arch]], model.cfg.num_layers)


def load_weights(model: CausalLM | DeepseekCausalLM, path: str | Path) -> None:
    """Every tensor of the model from the GGUF file, this rank's part of it: Q8_0 into int8 layers as stored."""
    name = Path(path).name
    tensors, names = _names(path, model)
    scales = scales_by_storage(model)
    missing: list[str] = []
    with torch.no_grad():
        for key, (dst, shape, slicer) in targets_of(model).items():
            gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
            t = tensors.get(gname) if gname else None
            if t is None:
                missing.append(gname or key)
                continue
            got = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
            if got != shape:
                raise WeightLoadError(f"{name}: tensor {gname!r} has shape {list(got)}, expected {list(shape)}")
            heads = _permuted_heads(t.name, model)
            if _is_q8_0(t):
                q, s = q8_0_blocks(t)
                if heads:
                    q, s = _unpermute(q, heads), _unpermute(s, heads)
                if dst.dtype == torch.int8:
                    if not scales[dst.untyped_storage().data_ptr()][1]:
                        raise WeightLoadError(f"{name}: {gname!r} is Q8_0 where pdserve keeps per-row int8 scales")
                    store_blocks(key, dst, shape, slicer, q, s, scales)
                    continue
                full = (q.float().unflatten(-1, (-1, INT8_GROUP)) * s.unsqueeze(-1)).flatten(-2)  # exact in float32
            else:
                full = _floats(t).reshape(shape)
                if heads:
                    full = _unpermute(full, heads)
            store(key, dst, shape, slicer, full, scales)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightLoadError(f"{name}: missing tensor(s) {', '.join(repr(k) for k in missing[:3])}{more}")


def lm_head_q8_0(model: CausalLM | DeepseekCausalLM, path: str | Path) -> Int8Weight | None:
    """This rank's vocab shard of the file's Q8_0 output matrix (the token embedding where the head is tied to it),
    as quant.quantize_lm_head lays out a head; None where that matrix is not Q8_0."""
    tensors, _ = _names(path, model)
    t = tensors.get("token_embd.weight" if model.cfg.tie_word_embeddings else "output.weight")
    if t is None or not _is_q8_0(t):
        return None
    q, s = q8_0_blocks(t)
    first, n = model.ps.vocab_shard(q.shape[0])
    return Int8Weight(q[first : first + n].contiguous(), s[first : first + n].contiguous())
