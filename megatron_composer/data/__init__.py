"""Tokenizers, pretraining (indexed/blended) and SFT (chat) datasets, and the shared chat template."""

from megatron_composer.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

__all__ = ["Tokenizer", "TokenizerError", "load_tokenizer"]
