"""The worker: takes requests from the store's queue, runs them on the engine, writes their tokens back."""
