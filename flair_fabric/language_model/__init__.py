"""Training flair's character language models (Flair embeddings) on several processes: the batchified text is cut
into columns, each rank trains its share of them, and validation perplexity is computed across the ranks."""
