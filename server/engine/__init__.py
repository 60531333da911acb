"""Inference engine: model loading, sampling, detokenisation and the generation loop (no sockets, no redis)."""
