"""Byte-level BPE tokenizers for the tiny models, built with the `tokenizers` library.

Two kinds, same special tokens and chat template (ChatML, as Qwen uses):

- :func:`byte_level_tokenizer`: no merges, 256 byte tokens + specials; needs no training, so the tiny
  random-init presets (vocab 512) get a real tokenizer at once.
- :func:`train_bpe_tokenizer`: a byte-level BPE trained on given texts (the embedded default model).

:func:`load_tokenizer` loads the tokenizer of any model name or folder (a tiny preset's is the
byte-level one).

Prompts are built with ``tokenizer.apply_chat_template(messages, add_generation_prompt=True)``. The
reasoning delimiters ``<think>`` / ``</think>`` are single tokens that survive
``decode(skip_special_tokens=True)``, as in Qwen3.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

PAD_TOKEN = "<|pad|>"
EOT_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

SPECIAL_TOKENS = [PAD_TOKEN, EOT_TOKEN, IM_START, IM_END]
"""Control tokens (ids 0..3 in this order; skipped by ``decode(skip_special_tokens=True)``)."""
TEXT_TOKENS = [THINK_OPEN, THINK_CLOSE]
"""Single-token delimiters that remain in decoded text (the last two ids of the vocabulary)."""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
"""ChatML: ``<|im_start|>role\\ncontent<|im_end|>\\n`` per message; the generation prompt opens the
assistant turn (and a ``<think>`` block when ``enable_thinking=True`` is passed)."""


def _wrap(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD_TOKEN,
        eos_token=IM_END,
        unk_token=None,
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _base_tokenizer(vocab: dict[str, int] | None = None, merges: list[tuple[str, str]] | None = None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges) if vocab is not None else models.BPE())
    # digits one by one (before the byte-level split): a merged "47" would make every 2-digit number its own
    # token, and digit-wise arithmetic (the arith task's worked solutions) a lookup of thousands of ids
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _add_text_tokens(tok) -> None:
    from tokenizers import AddedToken

    tok.add_tokens([AddedToken(t, special=False, normalized=False, single_word=False) for t in TEXT_TOKENS])


def byte_level_tokenizer(model_max_length: int = 4096):
    """Untrained byte-level tokenizer: ids 0-3 control tokens, 4-259 the 256 bytes, 260-261
    ``<think>``/``</think>`` (262 ids; fits the tiny presets' vocabulary of 512)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(alphabet)})
    tok = _base_tokenizer(vocab, [])
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    _add_text_tokens(tok)
    return _wrap(tok, model_max_length)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, model_max_length: int = 4096,
                        min_frequency: int = 2, show_progress: bool = False):
    """Train a byte-level BPE on ``texts``; the result has exactly ``vocab_size`` ids (control tokens
    first, ``<think>``/``</think>`` last) and the ChatML chat template."""
    from tokenizers import pre_tokenizers, trainers

    n_fixed = len(SPECIAL_TOKENS) + len(TEXT_TOKENS)
    if vocab_size < 256 + n_fixed:
        raise ValueError(f"vocab_size {vocab_size} is below the {256 + n_fixed} ids of bytes + special tokens")
    tok = _base_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TEXT_TOKENS),
        min_frequency=min_frequency,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )

    def batches(it: Iterable[str], n: int = 1000) -> Iterator[list[str]]:
        buf: list[str] = []
        for t in it:
            buf.append(t)
            if len(buf) == n:
                yield buf
                buf = []
        if buf:
            yield buf

    tok.train_from_iterator(batches(texts), trainer=trainer)
    _add_text_tokens(tok)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise RuntimeError(f"BPE training gave {got} ids instead of {vocab_size} (corpus too small for the vocabulary?)")
    return _wrap(tok, model_max_length)


def load_tokenizer(name_or_path: str | os.PathLike) -> Any:
    """The tokenizer of a model: the byte-level tokenizer for a tiny preset name, else transformers'
    AutoTokenizer of a folder or Hub id (remote code off). A name that is not an existing path goes
    through :func:`expertcast.models.names.resolve_model` first, so it accepts what ``--model`` accepts
    (e.g. the ``tiny-default`` a cue set records as its tokenizer: its last build)."""
    from expertcast.models.names import ModelNotFoundError, resolve_model
    from expertcast.models.presets import get_preset, is_preset

    name = str(name_or_path)
    if not Path(name).expanduser().exists():  # a folder is read as it is (a tokenizer needs no config.json)
        try:
            name = resolve_model(name)
        except ModelNotFoundError as e:
            raise FileNotFoundError(f"cannot load a tokenizer from {name!r}: {e}") from None
    if is_preset(name):
        preset = get_preset(name)
        if preset.size == "tiny":
            return byte_level_tokenizer()
        name = preset.hub_id
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FileNotFoundError(f"cannot load a tokenizer from {name!r}: {first}") from None
