"""Pure-Python BERT (WordPiece) tokenizer, no `transformers`/`tokenizers`.

Two tokenizers over the same vocabulary:

* `BertTokenizer`: what Hugging Face's `BertTokenizerFast` does for an
  uncased BERT vocab (BertNormalizer -> BertPreTokenizer -> WordPiece ->
  `[CLS] ... [SEP]`). Used for the `tokenizer.ggml.pre` fingerprint in
  `convert_embedding.py` and by `embed_numpy_check.py` as the reference
  tokenization.
* `llama_wpm_tokenize`: what llama.cpp's WPM tokenizer does on the GGUF
  "phantom space" vocab (`##x` -> `x`, `x` -> `\u2581x`). Used by
  `embed_numpy_check.py --gguf` to check that the converted vocab tokenizes
  the same way.
"""

from __future__ import annotations

import unicodedata

PHANTOM = "\u2581"


def load_vocab_txt(text: str) -> dict[str, int]:
    """vocab.txt: one token per line, id = line number."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    vocab: dict[str, int] = {}
    for i, line in enumerate(lines):
        vocab.setdefault(line.rstrip("\r"), i)
    return vocab


def _is_whitespace(ch: str) -> bool:
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_chinese_char(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


class BertTokenizer:
    """Uncased BERT tokenizer (lowercase + strip accents, like HF for `do_lower_case`)."""

    def __init__(
        self,
        vocab: dict[str, int],
        *,
        lowercase: bool = True,
        strip_accents: bool | None = None,
        unk_token: str = "[UNK]",
        cls_token: str = "[CLS]",
        sep_token: str = "[SEP]",
        special_tokens: tuple[str, ...] = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"),
        max_input_chars_per_word: int = 100,
    ) -> None:
        self.vocab = vocab
        self.lowercase = lowercase
        # HF: strip_accents=None means "follow lowercase".
        self.strip_accents = lowercase if strip_accents is None else strip_accents
        self.unk_id = vocab[unk_token]
        self.cls_id = vocab[cls_token]
        self.sep_id = vocab[sep_token]
        self.special_tokens = tuple(t for t in special_tokens if t in vocab)
        self.max_input_chars_per_word = max_input_chars_per_word

    # --- normalizer + pre-tokenizer ------------------------------------
    def normalize(self, text: str) -> str:
        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD or _is_control(ch):
                continue
            if _is_whitespace(ch):
                out.append(" ")
            elif _is_chinese_char(cp):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        text = "".join(out)
        if self.strip_accents:
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        if self.lowercase:
            text = text.lower()
        return text

    @staticmethod
    def pre_tokenize(text: str) -> list[str]:
        words: list[str] = []
        cur: list[str] = []
        for ch in text:
            if ch.isspace():
                if cur:
                    words.append("".join(cur))
                    cur = []
            elif _is_punctuation(ch):
                if cur:
                    words.append("".join(cur))
                    cur = []
                words.append(ch)
            else:
                cur.append(ch)
        if cur:
            words.append("".join(cur))
        return words

    # --- WordPiece -----------------------------------------------------
    def wordpiece(self, word: str) -> list[int]:
        if len(word) > self.max_input_chars_per_word:
            return [self.unk_id]
        ids: list[int] = []
        start = 0
        while start < len(word):
            end = len(word)
            found = None
            while start < end:
                piece = word[start:end]
                if start > 0:
                    piece = "##" + piece
                if piece in self.vocab:
                    found = self.vocab[piece]
                    break
                end -= 1
            if found is None:
                return [self.unk_id]
            ids.append(found)
            start = end
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        for word in self.pre_tokenize(self.normalize(text)):
            ids.extend(self.wordpiece(word))
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # Added special tokens ("[SEP]" typed in the text) are matched before
        # normalization, like HF's added-token splitting.
        ids: list[int] = []
        rest = text
        while rest:
            hits = [(rest.find(t), t) for t in self.special_tokens if t in rest]
            if not hits:
                ids.extend(self._encode_plain(rest))
                break
            pos, tok = min(hits)
            ids.extend(self._encode_plain(rest[:pos]))
            ids.append(self.vocab[tok])
            rest = rest[pos + len(tok):]
        if add_special_tokens:
            ids = [self.cls_id] + ids + [self.sep_id]
        return ids


def llama_wpm_tokenize(
    text: str,
    token_to_id: dict[str, int],
    *,
    bos_id: int,
    sep_id: int,
    unk_id: int,
    lowercase: bool = True,
    strip_accents: bool = True,
) -> list[int]:
    """Mirror of llama.cpp's `llm_tokenizer_wpm_session` (add_special = true).

    `token_to_id` is the GGUF token list (phantom-space form).
    """
    max_len = max(len(t) for t in token_to_id)
    cps = unicodedata.normalize("NFD", text) if strip_accents else text
    words = [""]
    for ch in cps:
        cp = ord(ch)
        if ch.isspace():
            if words[-1]:
                words.append("")
            continue
        if cp == 0 or cp == 0xFFFD or unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn"):
            continue
        if strip_accents and unicodedata.category(ch) == "Mn":
            continue
        s = ch.lower() if lowercase else ch
        is_punct = unicodedata.category(ch).startswith("P")
        is_sym = unicodedata.category(ch).startswith("S")
        if is_punct or (cp < 0x7F and is_sym) or _is_chinese_char(cp):
            if words[-1]:
                words.append("")
            words[-1] = s
            words.append("")
        else:
            words[-1] += s
    if not words[-1]:
        words.pop()

    out = [bos_id]
    for word in words:
        if not word:
            continue
        w = PHANTOM + word
        n = len(w)
        start_len = len(out)
        i = 0
        ok = True
        while i < n:
            match = False
            for j in range(min(n, i + max_len + 1), i, -1):
                tid = token_to_id.get(w[i:j])
                if tid is not None:
                    out.append(tid)
                    match = True
                    i = j
                    break
            if not match:
                del out[start_len:]
                ok = False
                break
        if not ok or len(out) == start_len:
            out.append(unk_id)
    out.append(sep_id)
    return out
