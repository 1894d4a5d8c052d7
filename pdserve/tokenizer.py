"""Tokenizer from tokenizer.json (HF `tokenizers`), or from a GGUF file's metadata through transformers, with the
checkpoint's chat template and incremental detokenizing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        conf: dict[str, Any] = {}
        if path.suffix == ".gguf":
            self._tok, conf = _from_gguf(path)
        else:
            tj = path / "tokenizer.json"
            if not tj.is_file():
                raise FileNotFoundError(f"{tj}: not found; the model directory needs tokenizer.json")
            self._tok = HFTokenizer.from_file(str(tj))
            if (path / "tokenizer_config.json").is_file():
                conf = json.loads((path / "tokenizer_config.json").read_text())
            if (path / "chat_template.jinja").is_file():
                conf["chat_template"] = (path / "chat_template.jinja").read_text()
        template = conf.get("chat_template")
        self.chat_template: str | None = template
        self.bos_token = _token_str(conf.get("bos_token"))
        self.eos_token = _token_str(conf.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(conf.get("add_bos_token", False))
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and self.bos_token:
            bos = self._tok.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (for its streaming decoder)."""
        return self._tok

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text; tools (OpenAI tool objects) are passed to it as `tools`, as transformers'
        apply_chat_template does (a template that does not use them renders none)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead of chat messages")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class IncrementalDetokenizer:
    """Text deltas for a growing token list; holds back an incomplete UTF-8 tail so no delta is ever rewritten."""

    def __init__(self, tok: Tokenizer, prompt_ids: list[int]) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        full = self.tok.decode(self.ids)
        if full.endswith("\ufffd"):
            return ""
        delta = full[len(self.text) :]
        self.text = full
        return delta


def _from_gguf(path: Path) -> tuple[HFTokenizer, dict[str, Any]]:
    """A GGUF file's tokenizer as transformers rebuilds it from the file's metadata, with tokenizer_config.json's
    fields that this class reads."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ValueError(
            f"{path}: a GGUF model's tokenizer needs the transformers package (pdserve's dependency; the runtime "
            "image leaves it out): pip install transformers, or give the HF checkpoint directory"
        ) from None
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    conf = {
        "chat_template": tok.chat_template,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
    }
    return tok.backend_tokenizer, conf


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


def _raise(msg: str) -> None:
    raise jinja2.TemplateError(msg)
