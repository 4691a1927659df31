"""Train the one SentencePiece tokenizer shared by all tiers.

BPE, byte fallback (any text encodes), digits split one per token (arithmetic),
identity normalization (JSON is kept byte for byte), and every chat marker of
`corpus.SPECIAL_TOKENS` as a single user-defined token.

    python3 models/recipe/tokenizer.py --out models/tokenizer
"""

from __future__ import annotations

import argparse
import os

import sentencepiece as spm

import corpus

VOCAB_SIZE = 3072


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="models/tokenizer", help="output folder")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--examples", type=int, default=20000)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    text_path = os.path.join(a.out, "tokenizer-train.txt")
    with open(text_path, "w") as f:
        for ex in corpus.generate(a.seed + 99, a.examples, "train"):
            f.write(ex.text().replace("\n", " ") + "\n")
    spm.SentencePieceTrainer.train(
        input=text_path,
        model_prefix=os.path.join(a.out, "tokenizer"),
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        user_defined_symbols=corpus.SPECIAL_TOKENS + ["\n"],
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        num_threads=2,
        input_sentence_size=200000,
        shuffle_input_sentence=False,
        max_sentence_length=16384,
        minloglevel=2,
    )
    os.remove(text_path)
    os.remove(os.path.join(a.out, "tokenizer.vocab"))
    sp = spm.SentencePieceProcessor(model_file=os.path.join(a.out, "tokenizer.model"))
    for t in corpus.SPECIAL_TOKENS:
        assert len(sp.encode(t)) == 1, t
    print(f"vocab={sp.get_piece_size()} -> {a.out}/tokenizer.model")


if __name__ == "__main__":
    main()
