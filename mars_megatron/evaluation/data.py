"""Problems for evaluation and training: the record and the loader live in :mod:`mars_megatron.problems`
(JSONL, Parquet, Arrow, ``datasets`` folders, a field mapping and a filter); this module keeps the names
the evaluation has always imported."""

from __future__ import annotations

from mars_megatron.problems import Dataset, FieldMap, Problem, load_problems
from mars_megatron.problems.mapping import ANSWER_KEYS, PROBLEM_KEYS
from mars_megatron.problems.sources import MAX_LINE_BYTES

__all__ = ["ANSWER_KEYS", "MAX_LINE_BYTES", "PROBLEM_KEYS", "Dataset", "FieldMap", "Problem", "load_problems"]
