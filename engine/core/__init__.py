"""The control plane: sequences, KV block bookkeeping, scheduling, beam search, stops.

Plain Python and integers (host tensors at most): nothing here runs a kernel or holds a
device tensor, so it can run one step ahead of the worker."""
