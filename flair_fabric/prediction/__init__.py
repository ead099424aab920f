"""Prediction split across processes: in memory, or streamed from a file to a file."""

INPUT_FORMATS = ("text", "conll")
OUTPUT_FORMATS = ("jsonl", "conll")
