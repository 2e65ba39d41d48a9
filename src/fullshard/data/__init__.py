"""Tokenizer, corpora, binarized token datasets and data-parallel batch sampling.

Public API: :func:`load_gpt2_tokenizer` / :class:`GPT2Tokenizer`,
:func:`builtin_corpus_documents`, :func:`preprocess`, :func:`read_meta`,
:class:`TokenBlockDataset`, :class:`ShardedBatchSampler`, :class:`GlobalBatchSampler` with
:func:`global_micro_batch`, :class:`DataError`.
"""

from .binarize import PreprocessResult, preprocess
from .corpus import builtin_corpus_documents, read_text_documents, split_documents
from .dataset import TokenBlockDataset, read_meta
from .errors import DataError
from .sampler import GlobalBatchSampler, ShardedBatchSampler, global_micro_batch
from .tokenizer import GPT2Tokenizer, load_gpt2_tokenizer

__all__ = [
    "DataError",
    "GPT2Tokenizer",
    "GlobalBatchSampler",
    "PreprocessResult",
    "ShardedBatchSampler",
    "TokenBlockDataset",
    "builtin_corpus_documents",
    "global_micro_batch",
    "load_gpt2_tokenizer",
    "preprocess",
    "read_meta",
    "read_text_documents",
    "split_documents",
]
