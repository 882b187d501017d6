"""The rank floor: what runs on every rank (GPU) of an engine. The worker and its parts (model runner,
step input and buffers, CUDA graphs, swap), parallel state, the device-memory budget, and the executor
contract that drives the workers (docs/architecture.md)."""
