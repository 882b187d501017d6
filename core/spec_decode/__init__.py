"""The speculative-decoding floor: the drafter contract, the engine's speculation policy and counters,
the engine-side decoder that drives a drafter, and the rejection sampler (docs/speculative.md)."""
