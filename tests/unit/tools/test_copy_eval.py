"""tools/copy_eval.py: the copy gate's text gives every word the same tokens in both copies, so a model that copies
can pay nothing for the second."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def test_both_copies_of_every_word_are_the_same_tokens(rl_assets):
    from megatron_composer.data.tokenizer import load_tokenizer
    from tools.copy_eval import word_spans

    tok = load_tokenizer(rl_assets / "tok")
    words = ["alpha", "beta", "gamma", "delta"]
    ids, spans = word_spans(tok, words)
    first = [ids[a:b] for a, b in spans[:4]]
    second = [ids[a:b] for a, b in spans[4:]]
    assert first == second  # the first word too: a word at the very start of a text would be other tokens
    assert [tok.decode(t).strip() for t in first] == words
    assert spans[-1][1] == len(ids) and all(a < b for a, b in spans)
