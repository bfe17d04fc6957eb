"""Small BPE tokenizers built offline, for test-size models and models trained from scratch.

Nothing can be downloaded on the machines Tandem runs on, so a policy trained from scratch
(``policy.tokenizer: builtin``) and the tiny test checkpoints use tokenizers built here: a
byte-level-alphabet BPE (any text tokenizes) trained on a fixed corpus, saved with
``save_pretrained`` and loaded like any local tokenizer folder. :func:`builtin_tokenizer`
builds one once per (kind, vocabulary size) into a cache folder; a checkpoint written from
such a model carries a copy in its own ``tokenizer/`` folder.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

#: instructions the tiny tokenizers are trained on (any text still tokenizes: byte-level
#: alphabet), plus numbers for PI0.5's discretised state
CORPUS = [
    "pick up the black bowl between the plate and the ramekin and place it on the plate",
    "put the red block on the green block", "open the top drawer and put the bowl inside",
    "push the plate to the front of the stove", "turn on the stove", "reach the target",
    "In: What action should the robot take to pick up the cube?\nOut:",
    "Task: stack the boxes, State: 0 1 2 3;\nAction: ",
    " ".join(str(i) for i in range(256)),
]

#: what ``tokenizer: builtin`` is trained on: the corpus above plus LIBERO's instructions
#: (libero_spatial and libero_object), so they tokenize into few, word-sized tokens
LIBERO_INSTRUCTIONS = [
    *(f"pick up the black bowl {where} and place it on the plate" for where in (
        "between the plate and the ramekin", "next to the ramekin", "from table center", "on the cookie box",
        "in the top drawer of the wooden cabinet", "on the ramekin", "next to the cookie box", "on the stove",
        "next to the plate", "on the wooden cabinet")),
    *(f"pick up the {obj} and place it in the basket" for obj in (
        "alphabet soup", "cream cheese", "salad dressing", "bbq sauce", "ketchup", "tomato sauce", "butter",
        "milk", "chocolate pudding", "orange juice")),
]
BUILTIN_CORPUS = CORPUS + LIBERO_INSTRUCTIONS
BUILTIN = "builtin"


def build_tokenizer(path: str | Path, *, kind: str = "gemma", vocab_size: int = 400,
                    corpus: list[str] | None = None) -> Path:
    """A small BPE tokenizer saved with ``save_pretrained`` (loads offline).

    ``kind="gemma"``: PaliGemma's special ids (<pad>=0, <eos>=1, <bos>=2, <unk>=3), BOS
    prepended. ``kind="llama"``: Llama-2's (<unk>=0, <s>=1, </s>=2), BOS prepended, the
    SentencePiece space token "▁" in the vocabulary, and a <PAD> token appended after the
    base vocabulary as OpenVLA does.
    """
    corpus = CORPUS if corpus is None else corpus
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"] if kind == "gemma" else ["<unk>", "<s>", "</s>"]
    bos, eos, unk = (specials[2], specials[1], specials[3]) if kind == "gemma" else (specials[1], specials[2], specials[0])
    tok = Tokenizer(models.BPE(unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    alphabet = [chr(c) for c in range(32, 127)] + ["▁", "\n"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, initial_alphabet=alphabet,
                                  show_progress=False)
    tok.train_from_iterator(list(corpus) * 4, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    kw = dict(bos_token=bos, eos_token=eos, unk_token=unk)
    if kind == "gemma":
        kw["pad_token"] = "<pad>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **kw)
    if kind == "llama":
        fast.add_special_tokens({"pad_token": "<PAD>"})
    fast.save_pretrained(str(path))
    return path


def builtin_tokenizer(kind: str, vocab_size: int) -> Path:
    """The ``builtin`` tokenizer of ``kind`` (gemma | llama) and ``vocab_size``: built once from
    :data:`BUILTIN_CORPUS` into ``$TANDEM_CACHE`` (default ``~/.cache/tandem``)/tokenizers."""
    key = hashlib.sha256(repr((kind, vocab_size, BUILTIN_CORPUS)).encode()).hexdigest()[:12]
    root = Path(os.environ.get("TANDEM_CACHE", Path.home() / ".cache" / "tandem")) / "tokenizers"
    path = root / f"{kind}-{vocab_size}-{key}"
    if not (path / "tokenizer.json").exists():
        tmp = root / f".{path.name}.{os.getpid()}"
        build_tokenizer(tmp, kind=kind, vocab_size=vocab_size, corpus=BUILTIN_CORPUS)
        try:
            tmp.rename(path)
        except OSError:   # another process built it first
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
    return path
