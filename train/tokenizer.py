"""Train the default model's BPE tokenizer on the corpus and write the corpus as token ids.

    python train/tokenizer.py CORPUS_DIR      # -> CORPUS_DIR/tokenizer/ and CORPUS_DIR/tokens.npz

Byte-level BPE (no unknown characters), 8192 ids including the chat specials, and the ChatML-style
template the built-in models use (models/builtin.py). Documents are separated by <|endoftext|>.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

VOCAB = 8192
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def main(root: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from sluice.models.builtin import CHAT_TEMPLATE

    text = (root / "corpus.txt").read_text()
    docs = text.split("\n\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2)
    tok.train_from_iterator(docs, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(root / "tokenizer")
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(docs):
        ids.extend(enc.ids)
        ids.append(eot)
    arr = np.asarray(ids, dtype=np.uint16)
    np.savez_compressed(root / "tokens.npz", tokens=arr)
    print(f"vocab {tok.get_vocab_size()}, {len(arr) / 1e6:.1f}M tokens, {len(text) / len(arr):.2f} chars/token")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
