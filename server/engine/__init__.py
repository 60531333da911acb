"""Inference engine: model loading, sampling, detokenisation, the generation loop (no sockets, no redis)."""
