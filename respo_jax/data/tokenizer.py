"""Tokenizers behind one small interface: any Hugging Face `tokenizer.json` directory, via `tokenizers`.

The trainer and sampler only need text <-> ids, the special ids (pad, bos, eos) and, for chat models,
the chat template; `Tokenizer` is that interface, implemented here for HF directories (`HFTokenizer`)
and in `synthetic.py` for the in-process character tokenizer of the CPU experiment. The chat template
is rendered with Jinja2 the way `transformers` does (trim_blocks, lstrip_blocks, sandboxed), so no
`transformers` import is needed at run time.

A directory may hold: `tokenizer.json` (required), `tokenizer_config.json` (special tokens and
`chat_template`), `chat_template.jinja` (the template as its own file, newer layout) and
`generation_config.json` (extra end-of-sequence ids, e.g. both `<|im_end|>` and `<|endoftext|>`).
"""

from __future__ import annotations

import json
import os
from typing import Any, Protocol, Sequence, runtime_checkable

import tokenizers

from respo_jax.json_files import read_json


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of respo-jax uses of a tokenizer.

    encode(text, add_special_tokens): token ids; add_special_tokens applies the tokenizer's own
      post-processing (e.g. a BOS), which is wanted for raw prompts and not for chat-rendered ones.
    decode(ids, skip_special_tokens): text.
    eos_ids: every id that ends a response (the sampler's stop set); eos_id is the first of them.
    """

    vocab_size: int
    pad_id: int
    bos_id: int | None
    eos_id: int
    eos_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    @property
    def has_chat_template(self) -> bool: ...

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str: ...


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json stores it: a string or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token must be a string or {{'content': ...}}; got {value!r}")


def _read_json(path: str) -> dict:
    """A tokenizer's optional JSON file ({} when absent), read by the package's one JSON reader."""
    return read_json(path) if os.path.isfile(path) else {}


def _select_template(raw: Any, path: str) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} (take "default")."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {entry.get("name"): entry.get("template") for entry in raw if isinstance(entry, dict)}
        if "default" in named:
            return named["default"]
        raise ValueError(f"{path}: chat_template list has no 'default' entry (names: {sorted(named)})")
    raise ValueError(f"{path}: chat_template must be a string or a list; got {type(raw).__name__}")


def compile_chat_template(source: str):
    """A Jinja2 template compiled as `transformers` does (sandboxed, trim/lstrip blocks, loop controls,
    `tojson`, `raise_exception`), so templates written for HF render identically."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


class HFTokenizer:
    """A Hugging Face tokenizer directory loaded with `tokenizers` (no `transformers` needed)."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        pad_token: str | None,
        bos_token: str | None,
        eos_token: str | None,
        chat_template: str | None,
        extra_eos_ids: Sequence[int] = (),
        source: str = "<memory>",
    ):
        self._tok = tokenizer
        self.source = source
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.pad_token, self.bos_token, self.eos_token = pad_token, bos_token, eos_token
        self.bos_id = self._id_of(bos_token, "bos_token") if bos_token is not None else None
        eos_ids = [self._id_of(eos_token, "eos_token")] if eos_token is not None else []
        eos_ids += [i for i in extra_eos_ids if i not in eos_ids]
        if not eos_ids:
            raise ValueError(
                f"{source}: no eos_token in tokenizer_config.json and no eos ids in generation_config.json"
            )
        self.eos_ids = tuple(eos_ids)
        self.eos_id = self.eos_ids[0]
        # Without a pad token the first EOS pads (padding is always masked out).
        self.pad_id = self._id_of(pad_token, "pad_token") if pad_token is not None else self.eos_id
        self.chat_template = chat_template
        self._compiled = None

    def _id_of(self, token: str, role: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.source}: {role} {token!r} is not in the vocabulary")
        return token_id

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "HFTokenizer":
        path = os.fspath(path)
        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(
                f"{path}: no tokenizer.json (expected a Hugging Face tokenizer directory)"
            )
        config_path = os.path.join(path, "tokenizer_config.json")
        config = _read_json(config_path)
        chat_template = _select_template(config.get("chat_template"), config_path)
        jinja_path = os.path.join(path, "chat_template.jinja")
        if chat_template is None and os.path.isfile(jinja_path):
            with open(jinja_path, "r", encoding="utf-8") as handle:
                chat_template = handle.read()
        generation = _read_json(os.path.join(path, "generation_config.json"))
        extra = generation.get("eos_token_id", [])
        extra_eos = [extra] if isinstance(extra, int) else list(extra or [])
        return cls(
            tokenizers.Tokenizer.from_file(tokenizer_file),
            pad_token=_token_content(config.get("pad_token")),
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            chat_template=chat_template,
            extra_eos_ids=extra_eos,
            source=path,
        )

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The chat template rendered to text (tokenize it with `encode(..., add_special_tokens=False)`).

        Extra keyword arguments reach the template (e.g. `enable_thinking=False` for Qwen3).
        """
        if self.chat_template is None:
            raise ValueError(
                f"{self.source}: the tokenizer has no chat template; render prompts raw (base model)"
            )
        if self._compiled is None:
            self._compiled = compile_chat_template(self.chat_template)
        return self._compiled.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            **kwargs,
        )


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """The HF tokenizer directory at `path` (see the module docstring for the files it reads)."""
    return HFTokenizer.from_dir(path)
