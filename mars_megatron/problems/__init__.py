"""Problems of a task, read from the files researchers bring: JSONL, Parquet, Arrow, and Hugging Face
``datasets`` saved to disk (``save_to_disk`` folders, or folders of Parquet files as the Hub stores them),
mapped to one record (:class:`Problem`) by a field mapping and an optional filter."""

from mars_megatron.problems.load import load_problems
from mars_megatron.problems.mapping import FieldMap
from mars_megatron.problems.records import Dataset, Problem

__all__ = ["Dataset", "FieldMap", "Problem", "load_problems"]
