"""The text check of vLLM verification (``check_served_text``) on real tokenizers, without an engine.

Verification's criterion is the token ids; the text Triton returns is checked as derived from them by the
published tokenizer. The SmolLM2 example was refused (issue 36) because its prompt near ``max_model_len``,
cut at a token boundary inside a multi-byte character, ends in U+FFFD, and vLLM's detokenizer then returns
text of the prompt's tail before the generated text. Here every cut of such prompts, on a byte-level BPE
tokenizer (trained here), a SentencePiece one (trained here, with byte fallback, converted as transformers
converts Llama's) and SmolLM2-135M-Instruct's own, goes through ``vllm_served_text``, and each text must
pass; texts a fault would give must not.

``vllm_served_text`` is a stand-in for the engine (vLLM's CPU build needs AVX-512, which CI machines may
lack): the same ``tokenizers.decoders.DecodeStream`` vLLM's ``FastIncrementalDetokenizer`` runs, primed as it
primes it (the shortest suffix of 4 to 23 prompt tokens whose decoding holds no U+FFFD, else the whole prompt).
tests/test_vllm.py publishes the real SmolLM2 through the real engine where vLLM is installed.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from repo_manager.core.errors import VerificationError
from repo_manager.ops.publish.vllm import _prompt_near_limit, check_served_text

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                reason="needs transformers and tokenizers")

TEXT = "Zürich 東京 🦜🚀 café 北京"
"""Accents (2 bytes), CJK (3 bytes) and two 4-byte emoji, one (🦜) in no training text: byte tokens."""
SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Zürich, Tōkyō and São Paulo are cities; naïve café façade.",
    "東京は日本の首都です。 北京是中国的首都。",
    "Emoji: 🙂 🚀 🎉 and numbers 0 1 2 3 4 5 6 7 8 9.",
]


def vllm_served_text(tokenizer, prompt_ids: list[int], generated_ids: list[int]) -> str:
    """What vLLM's fast detokenizer returns for ``generated_ids`` after ``prompt_ids`` (the stand-in above)."""
    from tokenizers.decoders import DecodeStream

    backend = tokenizer.backend_tokenizer
    suffix = prompt_ids
    if len(prompt_ids) > 4:
        for i in range(4, min(len(prompt_ids) + 1, 24)):
            if "\ufffd" not in backend.decode(prompt_ids[-i:]):
                suffix = prompt_ids[-i:]
                break
    stream = DecodeStream(skip_special_tokens=True)
    for token in suffix:
        stream.step(backend, token)
    return "".join(stream.step(backend, token) or "" for token in generated_ids)


def byte_level_bpe(folder: Path):
    from llm_checkpoints import train_tokenizer
    from transformers import AutoTokenizer

    train_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def sentencepiece_bpe(folder: Path):
    """A SentencePiece BPE model with byte fallback, as Llama's, as transformers' fast Llama tokenizer."""
    sentencepiece = pytest.importorskip("sentencepiece")
    from transformers import LlamaTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SPM_CORPUS * 20), model_prefix=str(folder / "spm"), vocab_size=330,
        model_type="bpe", byte_fallback=True, character_coverage=0.98, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        minloglevel=2)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    vocab = {processor.id_to_piece(i): i for i in range(processor.get_piece_size())}
    tokenizer = LlamaTokenizer(vocab=vocab, merges=_merges(vocab), bos_token="<s>", eos_token="</s>",
                               unk_token="<unk>", add_bos_token=True)
    for text in [TEXT, *SPM_CORPUS]:  # the conversion is faithful: the same ids as SentencePiece's own
        assert tokenizer(text).input_ids == [1, *processor.encode(text)], text
    assert tokenizer.backend_tokenizer.model.byte_fallback
    return tokenizer


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """A SentencePiece BPE model's merges, as transformers derives them: every split of a piece into two
    pieces of the vocabulary, in the order of the piece, then of its parts (SentencePiece numbers its pieces
    by score)."""
    found = [(rank, vocab[piece[:i]], vocab[piece[i:]], piece[:i], piece[i:])
             for piece, rank in vocab.items() for i in range(1, len(piece))
             if piece[:i] in vocab and piece[i:] in vocab]
    return [(left, right) for *_, left, right in sorted(found)]


def smollm2():
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("reading the SmolLM2 example needs the gguf package (scripts/setup.sh installs it)")
    from transformers import AutoTokenizer

    from repo_manager.core.errors import InputError
    from repo_manager.ops.llm.examples import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except InputError as exc:
        pytest.skip(exc.message)
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


@pytest.fixture(scope="module", params=["byte-level BPE", "SentencePiece BPE", "SmolLM2"])
def tokenizer(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    return {"byte-level BPE": byte_level_bpe, "SentencePiece BPE": sentencepiece_bpe,
            "SmolLM2": lambda _folder: smollm2()}[request.param](folder)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def _old_rule_refuses(tokenizer, served: str, generated_ids: list[int]) -> bool:
    """The rule the SmolLM2 example failed: the text of the generated ids alone, or a prefix of it that held
    back a tail with U+FFFD."""
    want = _decode(tokenizer, generated_ids)
    return not (served == want or want.startswith(served) and "\ufffd" in want[len(served):])


def test_every_cut_inside_multibyte_characters_passes_and_the_old_rule_refused_some(tokenizer):
    """Prompts cut at every token of TEXT (inside each multi-byte character where the tokenizer splits it),
    each followed by the rest of TEXT and by TEXT up to the cut (a generation that ends inside a character)."""
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    split = sum("\ufffd" in _decode(tokenizer, ids[:cut]) for cut in range(1, len(ids)))
    assert split >= 3, "the tokenizer splits none of TEXT's characters: the test would prove nothing"
    checked = echoed = withheld = old_refused = 0
    for cut in range(1, len(ids)):
        prompt_text = _decode(tokenizer, ids[:cut])  # as verification's near-limit prompt is made
        prompt_ids = tokenizer(prompt_text).input_ids  # what vLLM reads: the text, encoded again
        for generated in (ids[cut:], ids[:cut], tokenizer(" 東京は🦜", add_special_tokens=False).input_ids):
            served = vllm_served_text(tokenizer, prompt_ids, generated)
            found = check_served_text(f"cut {cut}", served, prompt_ids, generated, tokenizer)
            checked += 1
            echoed += "prompt_text_in_output" in found
            withheld += "incomplete_utf8_tokens_withheld" in found
            old_refused += _old_rule_refuses(tokenizer, served, generated)
    assert checked == 3 * (len(ids) - 1)
    assert echoed > 0 and withheld > 0, (echoed, withheld)  # both allowances were exercised, not assumed
    assert old_refused > 0  # the fault of the issue, reproduced


def test_the_near_limit_prompts_of_verification_pass_at_every_length(tokenizer):
    """verification's own prompt near max_model_len, for every budget up to 160 tokens, followed by the
    generations the SmolLM2 example gave (repeated full-width brackets) and a multilingual one."""
    generations = [tokenizer("））））", add_special_tokens=False).input_ids,
                   tokenizer("São Paulo 🙂 東京", add_special_tokens=False).input_ids]
    cut_inside = 0
    for max_model_len in range(16, 168):
        prompt_text = _prompt_near_limit(tokenizer, max_model_len)
        prompt_ids = tokenizer(prompt_text).input_ids
        cut_inside += prompt_text.endswith("\ufffd")
        for generated in generations:
            served = vllm_served_text(tokenizer, prompt_ids, generated)
            check_served_text(f"near {max_model_len}", served, prompt_ids, generated, tokenizer)
    assert cut_inside > 0  # some budgets cut a character, as the SmolLM2 example's did


@pytest.fixture(scope="module")
def case(tokenizer):
    prompt_ids = tokenizer("Hello from Zürich, 東京").input_ids
    generated = tokenizer(" café 🦜 北京 ok", add_special_tokens=False).input_ids
    return prompt_ids, generated, vllm_served_text(tokenizer, prompt_ids, generated)


def test_the_served_text_itself_passes(tokenizer, case):
    prompt_ids, generated, served = case
    assert check_served_text("plain", served, prompt_ids, generated, tokenizer) == {}


@pytest.mark.parametrize("fault", ["the prompt echoed", "a character dropped", "cut short", "another tokenizer",
                                   "another generation"])
def test_text_a_fault_would_give_is_refused_in_one_line(tokenizer, case, fault, tmp_path):
    prompt_ids, generated, served = case
    wrong = {
        "the prompt echoed": lambda: _decode(tokenizer, prompt_ids) + served,  # exclude_input_in_output ignored
        "a character dropped": lambda: served.replace("🦜", "", 1),
        "cut short": lambda: served[:-3],
        "another tokenizer": lambda: _other(tokenizer, tmp_path).decode(generated, skip_special_tokens=True),
        "another generation": lambda: served.replace("北京", "東京"),
    }[fault]()
    assert wrong != served
    with pytest.raises(VerificationError) as raised:
        check_served_text("plain", wrong, prompt_ids, generated, tokenizer)
    error = raised.value
    assert error.exit_code == 5 and "\n" not in error.message and "plain:" in error.message
    decoded = error.message.split(" returned, ")[1].split(" decoded)")[0]
    assert json.loads(decoded).strip() == _decode(tokenizer, generated).strip()  # what the ids decode to


def _other(tokenizer, folder: Path):
    """A tokenizer with another vocabulary: the same ids decode to other text."""
    return byte_level_bpe(folder) if tokenizer.backend_tokenizer.model.byte_fallback else sentencepiece_bpe(folder)
