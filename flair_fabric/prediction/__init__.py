"""Prediction split across processes: in memory, or streamed from a file to a file."""
